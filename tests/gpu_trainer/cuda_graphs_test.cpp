// trainer.cuda_graphs on CUDA: under deterministic algorithms a graphed run gives bitwise the losses
// of an eager one in every precision (dropout, a cosine schedule changing the lr every step,
// validation in between); a graphed ResNet (BatchNorm buffers, the smaller last batch run eagerly)
// stays as close to an eager run as a second eager run does; graphed steps make no host sync and
// `auto` turns graphs on; NaN capture under graphs stops at the failing step with the pre-corruption
// weights of an eager run and replays exactly. What cannot be captured is a config error with
// `true` and trains eagerly with `auto`.
#include <gtest/gtest.h>

#include <cmath>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/config.h"
#include "strobe/core/callback.h"
#include "strobe/core/capture.h"
#include "strobe/core/model.h"
#include "runner/replay.h"
#include "tests/gpu_trainer/cuda_skip.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

#ifdef STROBE_TORCH_HAS_CUDA
extern int64_t g_guarded_steps;  // the `sync_guard` callback of trainer_cuda_test.cpp (this binary)
#endif

namespace {

std::string resnet_yaml(int64_t batches, int64_t num_samples) {
  return fmt::format(R"(name: graphs
seed: 5
trainer:
  max_epochs: 1
  limit_train_batches: {}
  limit_val_batches: 2
  val_check_interval: 20
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  enable_checkpointing: false
  enable_progress_bar: false
  device: cuda
model:
  name: resnet
  depth: 18
  num_classes: 10
  in_channels: 3
  width: 16
  stem: cifar
task:
  name: classification
data:
  name: synthetic_images
  image_size: 32
  channels: 3
  num_classes: 10
  num_samples: {}
  num_val_samples: 64
  batch_size: 64
  num_workers: 2
optimizer:
  name: adamw
  lr: 3.0e-4
scheduler:
  name: cosine
  warmup_steps: 10
  max_steps: 50
callbacks: []
)",
                     batches, num_samples);
}

std::string cuda_mlp_yaml() {
  std::string y = tiny_yaml();
  y.replace(y.find("device: cpu"), 11, "device: cuda");
  return y;
}

std::map<int64_t, double> losses(const std::string& dir) {
  std::map<int64_t, double> out;
  for (auto& [step, row] : read_csv(dir + "/metrics.csv", "train/loss")) out[step] = std::stod(row["train/loss"]);
  return out;
}

// A callback with an in-step hook (cuda_graphs must refuse it).
class GradPeek : public Callback, public InStepHooks {
 public:
  std::string name() const override { return "grad_peek"; }
  InStepHooks* in_step_hooks() override { return this; }
  void on_after_backward(TrainerView&, Module&) override {}
};
std::shared_ptr<Callback> make_grad_peek(config::Section& cfg) {
  cfg.finish();
  return std::make_shared<GradPeek>();
}
STROBE_REGISTER(callback_registry(), "grad_peek", make_grad_peek);

// fc -> relu -> fc with a fault on the device: y + 0 * log(threshold - mean(x)) is NaN exactly for
// the batches whose mean input exceeds `threshold` (known on the host from the data alone); with
// `spike: true`, y x 1000 there instead (a finite loss spike).
class GraphNanProbe : public Model {
 public:
  GraphNanProbe(double threshold, bool spike, bool overflow)
      : Model("GraphNanProbe"),
        fc1(register_module("fc1", torch::nn::Linear(16, 32))),
        bn(register_module("bn", torch::nn::BatchNorm1d(32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 4))),
        threshold(threshold),
        spike(spike),
        overflow(overflow) {}
  torch::Tensor forward(const Batch& batch) override {
    auto x = batch.at("image").flatten(1);
    // overflow: the chosen batches' inputs x 1e6, so fc1's output passes fp16's 65504 (not fp32's range).
    if (overflow) {
      auto h = torch::relu(bn->forward(fc1->forward(x * torch::where(x.mean() > threshold, 1e6, 1.0))));
      return fc2->forward(h);
    }
    auto h = torch::relu(bn->forward(fc1->forward(x)));
    if (spike) return fc2->forward(h) * torch::where(x.mean() > threshold, 1000.0, 1.0);
    return fc2->forward(h) + 0 * torch::log(threshold - x.mean());
  }
  std::string default_task() const override { return "classification"; }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
  double threshold;
  bool spike, overflow;
};
std::shared_ptr<Model> make_graph_probe(config::Section& cfg) {
  auto threshold = cfg.get_double("threshold", 1e9);
  auto spike = cfg.get_bool("spike", false);
  auto overflow = cfg.get_bool("overflow", false);
  cfg.finish();
  return std::make_shared<GraphNanProbe>(threshold, spike, overflow);
}
STROBE_REGISTER(model_registry(), "graph_nan_probe", make_graph_probe);

std::string probe_yaml(double threshold) {
  return fmt::format(R"(name: graph_nan
seed: 3
trainer:
  max_epochs: 1
  max_steps: 40
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  enable_checkpointing: false
  enable_progress_bar: false
  device: cuda
model:
  name: graph_nan_probe
  threshold: {:.17g}
data:
  name: synthetic_images
  image_size: 4
  channels: 1
  num_classes: 4
  num_samples: 512
  num_val_samples: 16
  batch_size: 8
  num_workers: 1
optimizer:
  name: adamw
  lr: 0.01
scheduler:
  name: none
callbacks: [{{name: nan_capture}}]
)",
                     threshold);
}

}  // namespace

TEST(CudaGraphs, UnderDeterministicAlgorithmsAGraphedRunGivesBitwiseTheLossesOfAnEagerRun) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // The MLP with dropout (the CUDA generator's offsets advance per replay as they do eagerly), a
  // cosine schedule with warm-up (the lr changes every step: a frozen lr would show at once), a
  // validation run each epoch, 60 steps: every logged loss must be the same bits.
  for (const char* precision : {"32", "bf16-mixed", "bf16-master", "16-mixed"}) {
    std::map<int64_t, std::map<std::string, std::string>> rows[2];
    for (int graphed = 0; graphed < 2; ++graphed) {
      std::string dir = temp_dir("graphs-bitwise");
      auto run = make_run(cuda_mlp_yaml(),
                          {std::string("trainer.precision=") + precision, "trainer.max_epochs=5", "scheduler.max_steps=60",
                           "trainer.deterministic=true", std::string("trainer.cuda_graphs=") + (graphed ? "true" : "false")},
                          dir);
      ASSERT_EQ(run->trainer->fit(), 0) << precision << " graphed=" << graphed;
      EXPECT_EQ(run->trainer->view().state().global_step, 60);
      if (graphed) {
        EXPECT_EQ(run->trainer->graph_counts().captures, 1) << precision;
        EXPECT_EQ(run->trainer->graph_counts().replays, 57) << precision << ": 60 steps = 3 eager warm-up steps + 57 replays";
      }
      rows[graphed] = read_csv(dir + "/metrics.csv", "train/loss");
    }
    at::globalContext().setDeterministicAlgorithms(false, false);
    at::globalContext().setDeterministicCuDNN(false);
    ASSERT_EQ(rows[0].size(), 60u) << precision;
    ASSERT_EQ(rows[1].size(), 60u) << precision;
    for (auto& [step, row] : rows[0]) {
      EXPECT_EQ(rows[1][step]["train/loss"], row["train/loss"]) << precision << " step " << step;
      EXPECT_EQ(rows[1][step]["val/loss"], row["val/loss"]) << precision << " step " << step;
    }
    EXPECT_LT(std::stod(rows[1].rbegin()->second["train/loss"]), std::stod(rows[1].begin()->second["train/loss"]))
        << precision << ": the graphed run learns";
  }
}

// optimizer.param_groups.freeze under graphs: the step captured while fc0 is frozen is dropped at
// the unfreeze (epoch 2), the warm-up runs anew and a second graph takes the step with fc0's
// gradients; bitwise the losses and weights of an eager run, fp32 and bf16-master.
TEST(CudaGraphs, AnUnfreezeCapturesAnewAndMatchesAnEagerRunBitwise) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const char* precision : {"32", "bf16-master"}) {
    std::map<int64_t, std::map<std::string, std::string>> rows[2];
    std::map<std::string, torch::Tensor> params[2];
    for (int graphed = 0; graphed < 2; ++graphed) {
      std::string dir = temp_dir("graphs-unfreeze");
      auto run = make_run(cuda_mlp_yaml(),
                          {std::string("trainer.precision=") + precision, "trainer.max_epochs=4", "scheduler.max_steps=48",
                           "trainer.deterministic=true", std::string("trainer.cuda_graphs=") + (graphed ? "true" : "false"),
                           "optimizer.param_groups={freeze: ['fc0.*'], unfreeze_at_epoch: 2, unfreeze_lr_scale: 0.5}"},
                          dir);
      const auto fc0 = run->module->net().named_parameters()["fc0.weight"].detach().clone();
      ASSERT_EQ(run->trainer->fit(), 0) << precision << " graphed=" << graphed;
      EXPECT_EQ(run->trainer->view().state().global_step, 48);
      EXPECT_FALSE(torch::equal(run->module->net().named_parameters()["fc0.weight"].detach().cpu(), fc0.cpu())) << precision;
      if (graphed) {
        EXPECT_EQ(run->trainer->graph_counts().captures, 2) << precision;
        EXPECT_EQ(run->trainer->graph_counts().replays, 42) << precision << ": 2 x (3 eager warm-up steps) + 42 replays";
      }
      rows[graphed] = read_csv(dir + "/metrics.csv", "train/loss");
      params[graphed] = params_of(*run->module);
    }
    at::globalContext().setDeterministicAlgorithms(false, false);
    at::globalContext().setDeterministicCuDNN(false);
    ASSERT_EQ(rows[0].size(), 48u) << precision;
    for (auto& [step, row] : rows[0]) EXPECT_EQ(rows[1][step]["train/loss"], row["train/loss"]) << precision << " step " << step;
    EXPECT_TRUE(bitwise_equal(params[0], params[1])) << precision;
  }
}

TEST(CudaGraphs, AGraphedResNetGivesTheLossesOfAnEagerOneOver50StepsInEveryPrecision) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // ResNet-18 (convolutions, BatchNorm buffers updated inside the graph), 50 full batches and a last
  // one of 32 images that runs eagerly. cuDNN's weight gradients use atomics, so two eager runs
  // already differ slightly: the graphed run must stay as close to an eager one as a second eager
  // run does (3x its largest difference, at least 1e-3 relative).
  for (const char* precision : {"32", "bf16-mixed", "bf16-master", "16-mixed"}) {
    std::map<int64_t, double> runs[3];  // eager, eager again, graphed
    for (int r = 0; r < 3; ++r) {
      const bool graphed = r == 2;
      std::string dir = temp_dir("graphs");
      auto run = make_run(resnet_yaml(51, 3232),
                          {std::string("trainer.precision=") + precision,
                           std::string("trainer.cuda_graphs=") + (graphed ? "true" : "false")},
                          dir);
      ASSERT_EQ(run->trainer->fit(), 0) << precision << " run " << r;
      EXPECT_EQ(run->trainer->view().state().global_step, 51);
      runs[r] = losses(dir);
      ASSERT_EQ(runs[r].size(), 51u) << precision;
      if (graphed) {
        EXPECT_EQ(run->trainer->graph_counts().captures, 1) << precision;
        EXPECT_EQ(run->trainer->graph_counts().replays, 47) << precision << ": 51 steps = 3 warm-up + 47 replays + the smaller last batch";
      }
    }
    auto worst = [&](const std::map<int64_t, double>& a, const std::map<int64_t, double>& b) {
      double w = 0;
      for (auto& [step, x] : a) w = std::max(w, std::abs(b.at(step) - x) / std::max(1.0, std::abs(x)));
      return w;
    };
    const double noise = worst(runs[0], runs[1]), graph = worst(runs[0], runs[2]);
    std::cout << "[ cuda_graphs ] " << precision << ": largest relative loss difference over 51 steps, eager vs eager "
              << noise << ", eager vs graphed " << graph << "\n";
    EXPECT_LE(graph, std::max(3 * noise, 1e-3)) << precision;
    for (auto& [step, l] : runs[2]) EXPECT_TRUE(std::isfinite(l)) << precision << " step " << step;
    EXPECT_LT(runs[2].rbegin()->second, runs[2].begin()->second) << precision << ": the graphed run learns";
  }
}

TEST(CudaGraphs, GraphedStepsMakeNoHostSyncAndAutoTurnsGraphsOn) {
  SKIP_WITHOUT_CUDA_DEVICE();
#ifdef STROBE_TORCH_HAS_CUDA
  g_guarded_steps = 0;
  std::string dir = temp_dir("graphs-nosync");
  auto run = make_run(resnet_yaml(40, 4096),
                      {"trainer.precision=bf16-mixed", "trainer.cuda_graphs=auto", "trainer.gradient_clip_val=1.0",
                       "trainer.log_every_n_steps=5", "callbacks=[{name: sync_guard, from: 4}, {name: nan_capture, spike: {metric: both, window: 16, warmup: 4}}]"},
                      dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  EXPECT_EQ(g_guarded_steps, 36) << "training batches 4..39 ran under sync-debug \"error\" (after the capture at 3, whose "
                                  "one synchronization hands the warm-up's cached memory back)";
  EXPECT_EQ(run->trainer->graph_counts().captures, 1);
  EXPECT_EQ(run->trainer->graph_counts().replays, 37);
  auto l = losses(dir);
  EXPECT_TRUE(l.count(5) && l.count(20) && l.count(40)) << "logged values of replayed steps reach metrics.csv";
#endif
}

// Both kinds of capture: a NaN step, and (fault spike) a finite loss spike caught by the spike
// detector, whose window lives on the device and is updated inside the captured graph.
TEST(CudaGraphs, NanCaptureUnderGraphsStopsAtTheFailingStepWithTheWeightsOfAnEagerRun) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const bool spike : {false, true}) {
    const std::vector<std::string> fault =
        spike ? std::vector<std::string>{"model.spike=true", "callbacks=[{name: nan_capture, spike: {window: 8, warmup: 4}}]"}
              : std::vector<std::string>{};
    // Mean input of each training batch, in the order training sees them (the loader is seeded).
    const std::vector<double> means = batch_means(probe_yaml(1e9), 64);
    // The first batch after step 8 whose mean exceeds every earlier one: well after the capture (step 4).
    const auto rise = first_rise(means, [](size_t i) { return i >= 8; });
    ASSERT_TRUE(rise && rise->index < 40u) << "no usable failing batch in the first 40";
    const size_t bad = rise->index;
    const double threshold = rise->threshold;
    std::map<std::string, torch::Tensor> weights[2];
    for (int graphed = 0; graphed < 2; ++graphed) {
      std::string dir = temp_dir("graphs-nan");
      auto sets = fault;
      sets.push_back(std::string("trainer.cuda_graphs=") + (graphed ? "true" : "false"));
      auto run = make_run(probe_yaml(threshold), sets, dir);
      ASSERT_EQ(run->trainer->fit(), 3) << "graphed=" << graphed << " spike=" << spike << ": the step stops the run with exit status 3";
      if (graphed) EXPECT_GT(run->trainer->graph_counts().replays, 3);
      const std::string cap = fmt::format("{}/nan/step_{}", dir, bad + 1);  // batch `bad` (0-based) is step bad + 1
      ASSERT_TRUE(std::filesystem::exists(cap + "/capture.ckpt")) << "graphed=" << graphed << ": no capture of step " << bad;
      auto data = checkpoint::load_checkpoint_file(cap + "/capture.ckpt");
      for (auto& [k, t] : data.tensors)
        if (k.rfind("model/", 0) == 0) weights[graphed][k] = t.to(torch::kCPU, torch::kDouble);
      auto report = capture::replay_capture(cap, {});
      EXPECT_TRUE(report["exact"].get<bool>()) << "graphed=" << graphed << "\n" << report.dump(2);
      if (spike) {
        EXPECT_EQ(report["kind"], "spike") << report.dump(2);
        EXPECT_TRUE(report["first_nonfinite"].is_null()) << report.dump(2);
        continue;
      }
      ASSERT_FALSE(report["first_nonfinite"].is_null());
      EXPECT_EQ(report["first_nonfinite"]["op"], "aten::log");
    }
    ASSERT_FALSE(weights[0].empty());
    ASSERT_EQ(weights[0].size(), weights[1].size());
    for (auto& [k, t] : weights[0]) {
      ASSERT_TRUE(weights[1].count(k)) << k;
      EXPECT_TRUE(torch::isfinite(weights[1][k]).all().item<bool>()) << k << ": the capture holds corrupted weights";
      EXPECT_TRUE(torch::allclose(weights[1][k], t, 1e-5, 1e-7)) << k << ": graphed and eager captures differ";
    }
  }
}

// strobe replay --diagnose of an fp16 overflow under 16-mixed: non-finite as captured, finite in
// fp32 (and in float64 on the CPU): the verdict is precision, naming fc1's op and fp16's limit.
TEST(CudaGraphs, DiagnoseCallsAnFp16OverflowThatFp32DoesNotHavePrecision) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const auto rise = first_rise(batch_means(probe_yaml(1e9), 64), [](size_t i) { return i >= 4; });
  ASSERT_TRUE(rise && rise->index < 40u);
  const std::string dir = temp_dir("graphs-fp16-overflow");
  {
    auto run = make_run(probe_yaml(rise->threshold), {"model.overflow=true", "trainer.precision=16-mixed"}, dir);
    ASSERT_EQ(run->trainer->fit(), 3);
  }
  auto r = capture::diagnose_capture(dir + "/nan", {});
  std::cout << capture::format_diagnosis(r);
  EXPECT_EQ(r["verdict"], "precision") << r.dump(2);
  const std::string ev = r["evidence"].dump();
  EXPECT_NE(ev.find("non-finite in 16-mixed and not in fp32"), std::string::npos) << ev;
  EXPECT_NE(ev.find("in fc1 (forward): its output (Half) crossed the Half limit 65504"), std::string::npos) << ev;
  ASSERT_GE(r["runs"].size(), 3u);
  EXPECT_EQ(r["runs"][2]["run"], "fp32");
  EXPECT_FALSE(r["runs"][2]["bad"].get<bool>());
}

TEST(CudaGraphs, WhatCannotBeCapturedIsAConfigErrorWithTrueAndEagerWithAuto) {
  SKIP_WITHOUT_CUDA_DEVICE();
  struct Case {
    std::vector<std::string> sets;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"trainer.accumulate_grad_batches=2"}, "needs accumulate_grad_batches: 1"},
      {{"optimizer.fused=false"}, "needs Strobe's fused optimizer step"},
      {{"callbacks=[{name: grad_peek}]"}, "callback 'grad_peek' runs hooks inside the step"},
  };
  for (const auto& c : cases) {
    auto sets = c.sets;
    sets.push_back("trainer.cuda_graphs=true");
    try {
      auto run = make_run(resnet_yaml(4, 512), sets, "");
      run->trainer->fit();
      ADD_FAILURE() << "no error for " << c.sets[0];
    } catch (const config::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(c.expect), std::string::npos) << e.what();
    }
    // `auto` trains the same run eagerly.
    sets.back() = "trainer.cuda_graphs=auto";
    auto run = make_run(resnet_yaml(6, 512), sets, "");
    ASSERT_EQ(run->trainer->fit(), 0) << c.sets[0];
    EXPECT_EQ(run->trainer->graph_counts().captures, 0) << c.sets[0];
    EXPECT_EQ(run->trainer->graph_counts().replays, 0) << c.sets[0];
  }
}
