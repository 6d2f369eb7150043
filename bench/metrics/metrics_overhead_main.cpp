// strobe_bench_metrics: the metrics-overhead benchmark of issue 4 (a program, not a timed test).
// resnet18 (models/resnet), batch 128, 1000 classes, bf16-mixed, SGD on one GPU: step time with no
// metrics vs with the five metrics of the seed (mean loss, accuracy, precision, recall, F1; macro,
// as TorchMetrics' defaults), computed and copied to pinned host memory asynchronously every
// --log-every steps; the classification metrics either each keep their own confusion matrix
// (strobe_separate) or share one through MetricCollection (strobe_shared). Modes are interleaved
// in rounds; medians are reported. Host-device syncs per step are counted with CUDA sync-debug
// mode "warn" and a counting warning handler.
// With --python PY, runs bench/metrics/torchmetrics_baseline.py in the same call so the naive
// TorchMetrics numbers (same GPU, same minute) sit next to ours. Target: overhead <= 0.5%, 0 syncs.
#include "framework/core/batch.h"
#include "framework/core/precision.h"
#include "framework/metrics/aggregation.h"
#include "framework/metrics/classification.h"
#include "framework/metrics/collection.h"
#include "framework/metrics/registry.h"
#include "models/resnet.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#ifdef STROBE_TORCH_HAS_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <iostream>
#include <memory>
#include <string>

namespace sm = strobe::metrics;
using nlohmann::json;

namespace {

struct Args {
  int64_t steps = 200, warmup = 20, rounds = 3, batch = 128, classes = 1000, log_every = 100;
  std::string device = "cuda", precision = "bf16-mixed", python, json_path;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + k);
      return argv[++i];
    };
    if (k == "--steps") a.steps = std::stoll(next());
    else if (k == "--warmup") a.warmup = std::stoll(next());
    else if (k == "--rounds") a.rounds = std::stoll(next());
    else if (k == "--batch") a.batch = std::stoll(next());
    else if (k == "--classes") a.classes = std::stoll(next());
    else if (k == "--log-every") a.log_every = std::stoll(next());
    else if (k == "--device") a.device = next();
    else if (k == "--precision") a.precision = next();
    else if (k == "--python") a.python = next();
    else if (k == "--json") a.json_path = next();
    else throw std::runtime_error("unknown argument " + k);
  }
  return a;
}

class SyncCounter : public c10::WarningHandler {
 public:
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") != std::string::npos) ++count;
  }
  int64_t count = 0;
};

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
    for (int i = 0; i < 5; ++i) {
      host.push_back(torch::empty({}, torch::dtype(torch::kFloat).pinned_memory(o.device.is_cuda())));
    }
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

struct Bench {
  Args args;
  torch::Device device;
  std::shared_ptr<strobe::Model> model;
  std::unique_ptr<torch::optim::SGD> opt;
  strobe::Batch batch;
  torch::Tensor target;

  void step(Metrics* metrics, int64_t i) {
    opt->zero_grad(true);
    torch::Tensor logits, loss;
    {
      strobe::AutocastGuard autocast(device, args.precision);
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

  void sync_device() {
    if (device.is_cuda()) torch::cuda::synchronize();
  }

  // Returns ms per step; counts syncs over 10 steps without a log interval when asked.
  enum class Mode { kNone, kSeparate, kShared };
  double run(Mode mode, double* syncs_per_step) {
    sm::MetricOptions o;
    o.device = device;
    o.num_classes = args.classes;
    std::unique_ptr<Metrics> metrics =
        mode == Mode::kNone ? nullptr : std::make_unique<Metrics>(o, mode == Mode::kShared);
    for (int64_t i = 0; i < args.warmup; ++i) step(metrics.get(), i);
    sync_device();
#ifdef STROBE_TORCH_HAS_CUDA
    if (syncs_per_step && device.is_cuda()) {
      SyncCounter counter;
      {
        c10::WarningUtils::WarningHandlerGuard guard(&counter);
        c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
        int64_t done = 0;
        for (int64_t i = args.warmup; done < 10; ++i) {
          if ((i + 1) % args.log_every == 0) continue;
          step(metrics.get(), i);
          ++done;
        }
        c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
      }
      *syncs_per_step = counter.count / 10.0;
      sync_device();
    }
#endif
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < args.steps; ++i) step(metrics.get(), i);
    sync_device();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / args.steps;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\nusage: strobe_bench_metrics [--steps N] [--warmup N] [--rounds N] [--batch N] "
                             "[--classes N] [--log-every N] [--device cuda|cpu] [--precision bf16-mixed|32] "
                             "[--python PY] [--json FILE]\n";
    return 2;
  }
  const torch::Device device(args.device);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::cerr << "no CUDA device visible; use --device cpu for a smoke run\n";
    return 2;
  }
  torch::manual_seed(0);
  Bench b{args, device, nullptr, nullptr, {}, {}};
  strobe::models::ResNetOptions ro;
  ro.depth = 18;
  ro.num_classes = args.classes;
  b.model = strobe::models::make_resnet(ro);
  b.model->to(device);
  b.model->train();
  b.opt = std::make_unique<torch::optim::SGD>(b.model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  b.batch["image"] = torch::randn({args.batch, 3, 224, 224}, torch::TensorOptions().device(device));
  b.target = torch::arange(args.batch, torch::TensorOptions().dtype(torch::kLong).device(device)).remainder(args.classes);

  const std::vector<std::pair<std::string, Bench::Mode>> modes = {
      {"none", Bench::Mode::kNone}, {"strobe_separate", Bench::Mode::kSeparate}, {"strobe_shared", Bench::Mode::kShared}};
  std::map<std::string, std::vector<double>> ms;
  std::map<std::string, double> syncs;
  for (int64_t r = 0; r < args.rounds; ++r) {
    for (const auto& [name, mode] : modes) {
      double s = -1;
      ms[name].push_back(b.run(mode, r == 0 ? &s : nullptr));
      if (r == 0) syncs[name] = s;
    }
  }
  const double base = median(ms["none"]);
  json cpp = json::object();
  for (const auto& [name, mode] : modes) {
    const double m = median(ms[name]);
    cpp[name] = {{"step_ms_median", m}, {"step_ms_rounds", ms[name]}, {"overhead_pct", (m / base - 1) * 100},
                 {"syncs_per_step", syncs[name]}};
    std::printf("c++    %-16s %8.3f ms/step  overhead %+6.2f%%  syncs/step %g\n", name.c_str(), m, (m / base - 1) * 100,
                syncs[name]);
  }
  json out = {{"workload", "resnet18 b" + std::to_string(args.batch) + " " + std::to_string(args.classes) +
                               " classes " + args.precision},
              {"device", args.device},
              {"steps_per_round", args.steps},
              {"rounds", args.rounds},
              {"cpp", cpp}};
  if (!args.python.empty()) {
    const std::string py_json = "/tmp/strobe_bench_metrics_python.json";
    const std::string cmd = args.python + " " + STROBE_BENCH_SOURCE_DIR + "/bench/metrics/torchmetrics_baseline.py" +
                            " --device " + args.device + " --batch " + std::to_string(args.batch) + " --classes " +
                            std::to_string(args.classes) + " --steps " + std::to_string(args.steps) + " --warmup " +
                            std::to_string(args.warmup) + " --rounds " + std::to_string(args.rounds) +
                            " --log-every " + std::to_string(args.log_every) +
                            (args.precision == "bf16-mixed" ? "" : " --no-bf16") + " --json " + py_json;
    std::fflush(stdout);
    if (std::system(cmd.c_str()) == 0) out["python"] = json::parse(std::ifstream(py_json));
    else std::fprintf(stderr, "python baseline failed: %s\n", cmd.c_str());
  }
  if (!args.json_path.empty()) std::ofstream(args.json_path) << out.dump(2) << "\n";
  return 0;
}
