// strobe_bench_metrics: the metrics-overhead benchmark of issue 4 (a program, not a timed test).
// resnet18 (models/resnet), batch 128, 1000 classes, bf16-mixed, SGD on one GPU: step time with no
// metrics vs with the five metrics of the seed (mean loss, accuracy, precision, recall, F1; macro,
// as TorchMetrics' defaults), computed and copied to pinned host memory asynchronously every
// --log-every steps; the classification metrics either each keep their own confusion matrix
// (strobe_separate) or share one through MetricCollection (strobe_shared). Modes are interleaved
// in rounds; medians are reported. Host-device syncs per step are counted with CUDA sync-debug
// mode "warn" and a counting warning handler.
// The measurement itself is strobe::bench::metrics_overhead (bench/lib), shared with
// `strobe bench metrics`.
// With --python PY, runs bench/metrics/torchmetrics_baseline.py in the same call so the naive
// TorchMetrics numbers (same GPU, same minute) sit next to ours. Target: overhead <= 0.5%, 0 syncs.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench/lib/bench.h"
#include "strobe/core/source_tree.h"

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
  strobe::bench::MetricsOverheadOptions mo;
  mo.steps = args.steps, mo.warmup = args.warmup, mo.rounds = args.rounds, mo.batch = args.batch;
  mo.classes = args.classes, mo.log_every = args.log_every, mo.device = args.device, mo.precision = args.precision;
  json out = strobe::bench::metrics_overhead(mo);
  for (const auto& [name, v] : out["cpp"].items())
    std::printf("c++    %-16s %8.3f ms/step  overhead %+6.2f%%  syncs/step %g\n", name.c_str(),
                v["step_ms_median"].get<double>(), v["overhead_pct"].get<double>(), v["syncs_per_step"].get<double>());
  if (!args.python.empty()) {
    const std::string py_json = "/tmp/strobe_bench_metrics_python.json";
    const std::string cmd = args.python + " " + strobe::source_tree() + "/bench/metrics/torchmetrics_baseline.py" +
                            " --device " + args.device + " --batch " + std::to_string(args.batch) + " --classes " +
                            std::to_string(args.classes) + " --steps " + std::to_string(args.steps) + " --warmup " +
                            std::to_string(args.warmup) + " --rounds " + std::to_string(args.rounds) +
                            " --log-every " + std::to_string(args.log_every) +
                            (args.precision == "bf16-mixed" ? "" : " --no-bf16") + " --json " + py_json;
    std::fflush(stdout);
    if (std::system(cmd.c_str()) == 0) out["python"] = json::parse(std::ifstream(py_json));
    else std::fprintf(stderr, "python baseline failed: %s\n", cmd.c_str());
  }
  if (!args.json_path.empty()) strobe::bench::write_json_atomic(args.json_path, out);
  return 0;
}
