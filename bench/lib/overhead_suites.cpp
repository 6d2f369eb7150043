// The overhead suites: metrics (issue 4) and nan_capture (issue 9), moved here from
// bench/metrics/metrics_overhead_main.cpp and bench/nan/nan_overhead_main.cpp, which now call them.
#include <fmt/format.h>
#include <torch/torch.h>

#include "bench/lib/bench.h"
#include "strobe/config/config.h"
#include "strobe/core/precision.h"
#include "strobe/data/batch.h"
#include "strobe/metrics/aggregation.h"
#include "strobe/metrics/classification.h"
#include "strobe/metrics/collection.h"
#include "strobe/metrics/registry.h"
#include "models/resnet.h"
#include "runner/experiment_builder.h"

#ifdef STROBE_TORCH_HAS_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace strobe::bench {
namespace {

namespace sm = strobe::metrics;

class SyncCounter : public c10::WarningHandler {
 public:
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") != std::string::npos) ++count;
  }
  int64_t count = 0;
};

// Counts the host-device syncs `fn` makes (CUDA sync-debug mode "warn" + a counting handler).
int64_t count_syncs(const std::function<void()>& fn) {
#ifdef STROBE_TORCH_HAS_CUDA
  SyncCounter counter;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&counter);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    fn();
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
  return counter.count;
#else
  fn();
  return -1;
#endif
}

// Mean loss + accuracy/precision/recall/F1. `shared`: the four classification metrics share one
// confusion matrix through MetricCollection (one update for the four); otherwise each metric keeps
// its own (four updates), as four independent metric objects would.
struct Metrics {
  sm::MeanMetric loss;
  sm::MetricCollection classification;
  std::vector<std::unique_ptr<sm::MetricCollection>> separate;
  std::vector<torch::Tensor> host;  // pinned, one slot per metric
  Metrics(const sm::MetricOptions& o, bool shared) : loss(o) {
    for (const char* name : {"accuracy", "precision", "recall", "f1"}) {
      if (shared) {
        classification.add(name, sm::make_metric(name, o));
      } else {
        separate.push_back(std::make_unique<sm::MetricCollection>());
        separate.back()->add(name, sm::make_metric(name, o));
      }
    }
    for (int i = 0; i < 5; ++i)
      host.push_back(torch::empty({}, torch::dtype(torch::kFloat).pinned_memory(o.device.is_cuda())));
  }
  void update(const torch::Tensor& l, const torch::Tensor& logits, const torch::Tensor& target) {
    loss.update(l);
    classification.update(logits, target);
    for (auto& c : separate) c->update(logits, target);
  }
  void log_and_reset() {
    host[0].copy_(loss.compute(), /*non_blocking=*/true);
    int i = 1;
    for (auto& [name, value] : classification.compute()) host[i++].copy_(value, /*non_blocking=*/true);
    for (auto& c : separate) host[i++].copy_(c->compute()[0].second, /*non_blocking=*/true);
    loss.reset();
    classification.reset();
    for (auto& c : separate) c->reset();
  }
};

struct MetricsBench {
  MetricsOverheadOptions args;
  torch::Device device;
  strobe::Precision precision;  // args.precision, parsed once (not per step)
  std::shared_ptr<strobe::Model> model;
  std::unique_ptr<torch::optim::SGD> opt;
  strobe::Batch batch;
  torch::Tensor target;

  void step(Metrics* metrics, int64_t i) {
    opt->zero_grad(true);
    torch::Tensor logits, loss;
    {
      strobe::AutocastGuard autocast(device, precision);
      logits = model->forward(batch);
      loss = torch::cross_entropy_loss(logits, target);
    }
    loss.backward();
    opt->step();
    if (metrics) {
      metrics->update(loss.detach(), logits.detach(), target);
      if ((i + 1) % args.log_every == 0) metrics->log_and_reset();
    }
  }

  enum class Mode { kNone, kSeparate, kShared };
  // ms per step over args.steps steps; counts syncs over 10 steps without a log interval when asked.
  double run(Mode mode, double* syncs_per_step) {
    sm::MetricOptions o;
    o.device = device;
    o.num_classes = args.classes;
    std::unique_ptr<Metrics> metrics = mode == Mode::kNone ? nullptr : std::make_unique<Metrics>(o, mode == Mode::kShared);
    for (int64_t i = 0; i < args.warmup; ++i) step(metrics.get(), i);
    synchronize(device);
    if (syncs_per_step && device.is_cuda()) {
      const int64_t n = count_syncs([&] {
        int64_t done = 0;
        for (int64_t i = args.warmup; done < 10; ++i) {
          if ((i + 1) % args.log_every == 0) continue;
          step(metrics.get(), i);
          ++done;
        }
      });
      *syncs_per_step = n / 10.0;
      synchronize(device);
    }
    int64_t i = 0;
    return time_blocks([&] { step(metrics.get(), i++); }, 0, 1, args.steps, device).at(0);
  }
};

std::string nan_yaml(int64_t batch, const std::string& callbacks) {
  return fmt::format(R"(name: bench_nan
seed: 0
trainer:
  max_epochs: -1
  precision: bf16-mixed
  log_every_n_steps: 50
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_checkpointing: false
  device: cuda
logger:
  csv: false
model:
  name: resnet
  depth: 50
  num_classes: 20
  in_channels: 3
data:
  name: synthetic_images
  image_size: 224
  channels: 3
  num_classes: 20
  num_samples: {0}
  batch_size: {0}
  num_workers: 1
optimizer:
  name: adam
  lr: 1.0e-4
scheduler:
  name: none
callbacks: {1}
)",
                     batch * 64, callbacks);
}

}  // namespace

nlohmann::json metrics_overhead(const MetricsOverheadOptions& args) {
  const torch::Device device(args.device);
  torch::manual_seed(0);
  MetricsBench b{args, device, strobe::parse_precision(args.precision), nullptr, nullptr, {}, {}};
  strobe::models::ResNetOptions ro;
  ro.depth = 18;
  ro.num_classes = args.classes;
  b.model = strobe::models::make_resnet(ro);
  b.model->to(device);
  b.model->train();
  b.opt = std::make_unique<torch::optim::SGD>(b.model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  b.batch["image"] = torch::randn({args.batch, 3, 224, 224}, torch::TensorOptions().device(device));
  b.target = torch::arange(args.batch, torch::TensorOptions().dtype(torch::kLong).device(device)).remainder(args.classes);
  const std::vector<std::pair<std::string, MetricsBench::Mode>> modes = {{"none", MetricsBench::Mode::kNone},
                                                                         {"strobe_separate", MetricsBench::Mode::kSeparate},
                                                                         {"strobe_shared", MetricsBench::Mode::kShared}};
  std::map<std::string, std::vector<double>> ms;
  std::map<std::string, double> syncs;
  for (int64_t r = 0; r < args.rounds; ++r) {
    for (const auto& [name, mode] : modes) {
      double s = -1;
      ms[name].push_back(b.run(mode, r == 0 ? &s : nullptr));
      if (r == 0) syncs[name] = s;
    }
  }
  const double base = summarize(ms["none"]).median;
  nlohmann::json cpp = nlohmann::json::object();
  for (const auto& [name, mode] : modes) {
    const double m = summarize(ms[name]).median;
    cpp[name] = {{"step_ms_median", m},
                 {"step_ms_rounds", ms[name]},
                 {"overhead_pct", (m / base - 1) * 100},
                 {"syncs_per_step", syncs[name]}};
  }
  return {{"workload", fmt::format("resnet18 b{} {} classes {}", args.batch, args.classes, args.precision)},
          {"device", args.device},
          {"steps_per_round", args.steps},
          {"rounds", args.rounds},
          {"cpp", cpp}};
}

nlohmann::json nan_overhead(const NanOverheadOptions& a) {
  auto make = [&](const std::string& callbacks) {
    auto doc = config::Document::load_string(nan_yaml(a.batch, callbacks), "bench_nan.yaml");
    RunOptions ro;
    ro.create_run_dir = false;
    return build_run(doc, ro);
  };
  auto plain = make("[]");
  auto nan = make("[{name: nan_capture}]");
  auto spike = make("[{name: nan_capture, spike: {metric: both}}]");
  // Fixed host batches (pinned, as the loader delivers them); the same ones for both runs.
  std::vector<Batch> batches;
  torch::manual_seed(0);
  for (int i = 0; i < 8; ++i) {
    Batch b;
    b.tensors["image"] = torch::randn({a.batch, 3, 224, 224}).pin_memory();
    b.tensors["label"] = torch::randint(0, 20, {a.batch}, torch::kLong).pin_memory();
    b.meta["batch_size"] = a.batch;
    batches.push_back(b);
  }
  int64_t idx = 0;
  auto one = [&](Run& r) {
    r.trainer->run_batch(batches[idx % batches.size()], idx % 64);
    ++idx;
  };
  const torch::Device dev(torch::kCUDA);
  for (int64_t i = 0; i < a.warmup; ++i) one(*plain);
  for (int64_t i = 0; i < a.warmup; ++i) one(*nan);
  for (int64_t i = 0; i < a.warmup; ++i) one(*spike);
  synchronize(dev);
  std::vector<double> t_plain, t_nan, t_spike;
  auto block = [&](Run& r) { return time_blocks([&] { one(r); }, 0, 1, a.steps, dev).at(0); };
  for (int64_t round = 0; round < a.rounds; ++round) {
    // Alternate the order so neither mode always runs first.
    if (round % 2 == 0) {
      t_plain.push_back(block(*plain));
      t_nan.push_back(block(*nan));
      t_spike.push_back(block(*spike));
    } else {
      t_spike.push_back(block(*spike));
      t_nan.push_back(block(*nan));
      t_plain.push_back(block(*plain));
    }
  }
  const int64_t syncs = count_syncs([&] {
    for (int64_t i = 0; i < a.steps; ++i) one(*nan);
  });
  const int64_t spike_syncs = count_syncs([&] {
    for (int64_t i = 0; i < a.steps; ++i) one(*spike);
  });
  synchronize(dev);
  const double mp = summarize(t_plain).median, mn = summarize(t_nan).median, ms = summarize(t_spike).median;
  return {{"workload", fmt::format("resnet50 b{} bf16-mixed adam, 20 classes", a.batch)},
          {"steps_per_round", a.steps},
          {"rounds", a.rounds},
          {"plain_step_ms", t_plain},
          {"nan_capture_step_ms", t_nan},
          {"plain_median_ms", mp},
          {"nan_capture_median_ms", mn},
          {"overhead_pct", (mn / mp - 1.0) * 100.0},
          {"nan_capture_syncs_in_block", syncs},
          {"spike_step_ms", t_spike},
          {"spike_median_ms", ms},
          {"spike_overhead_pct", (ms / mp - 1.0) * 100.0},
          {"spike_syncs_in_block", spike_syncs},
          {"block_steps", a.steps}};
}

nlohmann::json metrics_suite(const SuiteOptions& o) {
  if (!o.cuda) return skipped("metrics", "needs a CUDA device (it measures the metrics' overhead on a GPU step)");
  MetricsOverheadOptions m;
  if (o.steps > 0) m.steps = o.steps;
  if (o.warmup >= 0) m.warmup = o.warmup;
  m.rounds = 5;
  const auto r = metrics_overhead(m);
  nlohmann::json out = {{"status", "ok"}, {"workloads", nlohmann::json::array()}, {"raw", r}};
  for (const auto& [mode, v] : r["cpp"].items()) {
    out["workloads"].push_back(
        {{"name", fmt::format("{} metrics={}", r["workload"].get<std::string>(), mode)},
         {"ms", to_json(summarize(v["step_ms_rounds"].get<std::vector<double>>()))},
         {"note", fmt::format("overhead {:+.2f}%, syncs/step {}, per-step ms of {} rounds x {} steps",
                              v["overhead_pct"].get<double>(), v["syncs_per_step"].get<double>(), m.rounds, m.steps)}});
  }
  return out;
}

nlohmann::json nan_capture_suite(const SuiteOptions& o) {
  if (!o.cuda) return skipped("nan_capture", "needs a CUDA device (it measures the capture's overhead on a GPU step)");
  NanOverheadOptions n;
  if (o.steps > 0) n.steps = o.steps;
  if (o.warmup >= 0) n.warmup = o.warmup;
  const auto r = nan_overhead(n);
  nlohmann::json out = {{"status", "ok"}, {"workloads", nlohmann::json::array()}, {"raw", r}};
  const std::string per = fmt::format("per-step ms of {} rounds x {} steps", n.rounds, n.steps);
  out["workloads"].push_back({{"name", r["workload"].get<std::string>() + " plain"},
                              {"ms", to_json(summarize(r["plain_step_ms"].get<std::vector<double>>()))},
                              {"note", per}});
  out["workloads"].push_back(
      {{"name", r["workload"].get<std::string>() + " nan_capture"},
       {"ms", to_json(summarize(r["nan_capture_step_ms"].get<std::vector<double>>()))},
       {"note", fmt::format("overhead {:+.2f}%, {} syncs in {} steps; {}", r["overhead_pct"].get<double>(),
                            r["nan_capture_syncs_in_block"].get<int64_t>(), n.steps, per)}});
  out["workloads"].push_back(
      {{"name", r["workload"].get<std::string>() + " nan_capture + spike (both)"},
       {"ms", to_json(summarize(r["spike_step_ms"].get<std::vector<double>>()))},
       {"note", fmt::format("overhead {:+.2f}%, {} syncs in {} steps; {}", r["spike_overhead_pct"].get<double>(),
                            r["spike_syncs_in_block"].get<int64_t>(), n.steps, per)}});
  return out;
}

}  // namespace strobe::bench
