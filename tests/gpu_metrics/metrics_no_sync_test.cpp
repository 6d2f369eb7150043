// CUDA metrics: every update/compute path runs under CUDA sync-debug mode "error" (any host-device
// synchronization throws), over many steps, and gives the same values as on the CPU.
#include "strobe/metrics/aggregation.h"
#include "strobe/metrics/classification.h"
#include "strobe/metrics/collection.h"
#include "strobe/metrics/detection.h"
#include "strobe/metrics/language.h"
#include "strobe/metrics/registry.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#ifdef STROBE_TORCH_HAS_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <functional>
#include <memory>

namespace sm = strobe::metrics;

namespace {

struct Step {
  torch::Tensor logits, labels, loss, weights, pred_boxes, target_boxes, binary_logits, binary_target, ml_probs,
      ml_target, lm_logits, tokens;
};

Step make_step(int64_t i, const torch::Device& device) {
  torch::manual_seed(i);
  Step s;
  s.logits = torch::randn({128, 1000});
  s.labels = torch::randint(0, 1000, {128});
  s.loss = torch::rand({});
  s.weights = torch::rand({128});
  s.pred_boxes = torch::rand({16, 256, 4}).cumsum(-1);
  s.target_boxes = torch::rand({16, 256, 4}).cumsum(-1);
  s.target_boxes.select(-1, 3).masked_fill_(torch::rand({16, 256}) < 0.9, 0.0);
  s.binary_logits = torch::randn({128});
  s.binary_target = torch::randint(0, 2, {128});
  s.ml_probs = torch::rand({128, 20});
  s.ml_target = torch::randint(0, 2, {128, 20});
  s.lm_logits = torch::randn({4, 64, 256}).to(torch::kBFloat16);
  s.tokens = torch::randint(-1, 256, {4, 64});
  s.logits.view({-1})[7] = std::numeric_limits<float>::quiet_NaN();
  for (auto* t : {&s.logits, &s.labels, &s.loss, &s.weights, &s.pred_boxes, &s.target_boxes, &s.binary_logits,
                  &s.binary_target, &s.ml_probs, &s.ml_target, &s.lm_logits, &s.tokens}) {
    *t = t->to(device);
  }
  return s;
}

struct Named {
  std::string name;
  std::unique_ptr<sm::Metric> metric;
  std::function<void(sm::Metric&, const Step&)> feed;
};

std::vector<Named> all_metrics(const torch::Device& device) {
  std::vector<Named> out;
  auto mc = [&](sm::Average avg, int64_t k, sm::NanStrategy nan) {
    sm::MetricOptions o;
    o.device = device;
    o.num_classes = 1000;
    o.average = avg;
    o.top_k = k;
    o.nan_strategy = nan;
    return o;
  };
  auto cls = [](sm::Metric& m, const Step& s) { m.update(s.logits, s.labels); };
  out.push_back({"accuracy_micro_top5", std::make_unique<sm::Accuracy>(mc(sm::Average::kMicro, 5, sm::NanStrategy::kIgnore)), cls});
  out.push_back({"precision_macro", std::make_unique<sm::Precision>(mc(sm::Average::kMacro, 1, sm::NanStrategy::kPropagate)), cls});
  out.push_back({"recall_weighted", std::make_unique<sm::Recall>(mc(sm::Average::kWeighted, 1, sm::NanStrategy::kReplace)), cls});
  out.push_back({"f1_macro", std::make_unique<sm::F1Score>(mc(sm::Average::kMacro, 1, sm::NanStrategy::kIgnore)), cls});
  sm::MetricOptions base;
  base.device = device;
  base.nan_strategy = sm::NanStrategy::kIgnore;
  out.push_back({"mean", std::make_unique<sm::MeanMetric>(base), [](sm::Metric& m, const Step& s) { m.update(s.loss); }});
  out.push_back({"mean_weighted", std::make_unique<sm::MeanMetric>(base),
                 [](sm::Metric& m, const Step& s) { m.update(s.weights, s.weights); }});
  out.push_back({"sum", std::make_unique<sm::SumMetric>(base), [](sm::Metric& m, const Step& s) { m.update(s.loss); }});
  out.push_back({"min", std::make_unique<sm::MinMetric>(base), [](sm::Metric& m, const Step& s) { m.update(s.weights); }});
  out.push_back({"max", std::make_unique<sm::MaxMetric>(base), [](sm::Metric& m, const Step& s) { m.update(s.weights); }});
  sm::MetricOptions cat = base;
  cat.capacity = 4096;
  out.push_back({"cat", std::make_unique<sm::CatMetric>(cat), [](sm::Metric& m, const Step& s) { m.update(s.weights); }});
  auto boxes = [](sm::Metric& m, const Step& s) { m.update(s.pred_boxes, s.target_boxes); };
  out.push_back({"mean_iou", std::make_unique<sm::MeanIoU>(base), boxes});
  out.push_back({"mean_giou", std::make_unique<sm::MeanGIoU>(base), boxes});
  sm::MetricOptions binary = base;
  binary.task = sm::Task::kBinary;
  out.push_back({"binary_f1", std::make_unique<sm::F1Score>(binary),
                 [](sm::Metric& m, const Step& s) { m.update(s.binary_logits, s.binary_target); }});
  sm::MetricOptions ml = base;
  ml.task = sm::Task::kMultilabel;
  ml.num_classes = 20;
  out.push_back({"multilabel_precision", std::make_unique<sm::Precision>(ml),
                 [](sm::Metric& m, const Step& s) { m.update(s.ml_probs, s.ml_target); }});
  sm::MetricOptions lm = base;
  lm.ignore_index = -1;
  out.push_back({"perplexity", std::make_unique<sm::Perplexity>(lm),
                 [](sm::Metric& m, const Step& s) { m.update(s.lm_logits, s.tokens); }});
  out.push_back({"token_accuracy", std::make_unique<sm::TokenAccuracy>(lm),
                 [](sm::Metric& m, const Step& s) { m.update(s.lm_logits, s.tokens); }});
  return out;
}

}  // namespace

TEST(GpuMetrics, SixtyUpdatesAndComputesNeverSynchronize) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  const torch::Device cuda(torch::kCUDA, 0);
  auto metrics = all_metrics(cuda);
  std::vector<Step> steps;
  for (int i = 0; i < 60; ++i) steps.push_back(make_step(i, cuda));
  torch::cuda::synchronize();
  // Pinned host buffers, allocated before the checked region (as the logger's ring is).
  std::vector<torch::Tensor> host;
  for (auto& m : metrics) {
    auto v = m.metric->compute();
    for (int k = 0; k < 3; ++k) host.push_back(torch::empty(v.sizes(), torch::dtype(v.scalar_type()).pinned_memory(true)));
  }
  // The four classification metrics of the seed, sharing one confusion matrix.
  sm::MetricCollection collection;
  for (const char* name : {"accuracy", "precision", "recall", "f1"}) {
    sm::MetricOptions o;
    o.device = cuda;
    o.num_classes = 1000;
    collection.add(name, sm::make_metric(name, o));
  }
  size_t copies = 0;
  auto& warn = c10::cuda::warning_state();
  warn.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    for (int i = 0; i < 60; ++i) {
      for (auto& m : metrics) m.feed(*m.metric, steps[i]);
      collection.update(steps[i].logits, steps[i].labels);
      if (i % 20 == 19) {  // a log interval: compute on the device, copy out asynchronously
        const size_t interval = i / 20;
        for (size_t k = 0; k < metrics.size(); ++k, ++copies) {
          host[k * 3 + interval].copy_(metrics[k].metric->compute(), /*non_blocking=*/true);
        }
        for (auto& [name, value] : collection.compute()) EXPECT_EQ(value.device(), cuda) << name;
        collection.reset();
      }
    }
  } catch (...) {
    warn.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    throw;
  }
  warn.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(copies, 3 * metrics.size());
  torch::cuda::synchronize();
  EXPECT_FALSE(std::isnan(host[2].item<float>()));  // top-5 accuracy (NaN rows ignored), 3rd interval
#endif
}

TEST(GpuMetrics, CudaValuesEqualCpuValues) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  auto gpu = all_metrics(torch::Device(torch::kCUDA, 0));
  auto cpu = all_metrics(torch::kCPU);
  for (int i = 0; i < 8; ++i) {
    auto sg = make_step(i, torch::Device(torch::kCUDA, 0));
    auto sc = make_step(i, torch::kCPU);
    for (size_t k = 0; k < gpu.size(); ++k) {
      gpu[k].feed(*gpu[k].metric, sg);
      cpu[k].feed(*cpu[k].metric, sc);
    }
  }
  for (size_t k = 0; k < gpu.size(); ++k) {
    auto g = gpu[k].metric->compute().cpu();
    auto c = cpu[k].metric->compute();
    EXPECT_TRUE(torch::allclose(g, c, 1e-4, 1e-5, /*equal_nan=*/true)) << gpu[k].name << ": " << g << " vs " << c;
  }
  // State moves between devices (a checkpoint written on GPU resumes on CPU).
  auto state = gpu[3].metric->state_dict();
  cpu[3].metric->load_state_dict(state);
  EXPECT_TRUE(torch::allclose(cpu[3].metric->compute(), gpu[3].metric->compute().cpu()));
#endif
}
