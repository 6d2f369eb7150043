// strobe_bench_nan: the NaN-capture overhead benchmark of issue 9 (a program, not a timed test).
// ResNet-50, batch 128, 20 classes, bf16-mixed, Adam lr 1e-4 (the seed's workload, as in
// shared/bench/pytorch_baselines.py nan), one GPU, through the trainer's own step path
// (Trainer::run_batch: batch transfer, forward, backward, StepPipeline, logging):
// the same model without callbacks, with nan_capture (check: both, action: stop) and with
// nan_capture plus spike detection on the loss and the gradient norm, built in one
// process and interleaved in rounds of --steps steps; CUDA events around each block, the median
// per-step time over rounds is reported. Host batches are pinned, as the loader delivers them.
// Host syncs of the nan_capture run are counted with CUDA sync-debug mode "warn".
// The measurement itself is strobe::bench::nan_overhead (bench/lib), shared with
// `strobe bench nan_capture`.
#include <cstdio>
#include <string>

#include <torch/torch.h>

#include "bench/lib/bench.h"

int main(int argc, char** argv) {
  strobe::bench::NanOverheadOptions a;
  std::string json_path;
  try {
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
      else if (k == "--json") json_path = next();
      else throw std::runtime_error("unknown argument " + k);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strobe_bench_nan: %s\nusage: strobe_bench_nan [--steps N] [--warmup N] [--rounds N] [--batch N] [--json FILE]\n", e.what());
    return 2;
  }
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "strobe_bench_nan: needs a CUDA device\n");
    return 2;
  }
  const auto j = strobe::bench::nan_overhead(a);
  const double mp = j["plain_median_ms"], mn = j["nan_capture_median_ms"];
  const double ms = j["spike_median_ms"];
  std::printf("resnet50 b%ld bf16-mixed: plain %.2f ms/step, nan_capture %.2f ms/step, overhead %+.2f%%, syncs %ld in %ld steps\n",
              static_cast<long>(a.batch), mp, mn, (mn / mp - 1.0) * 100.0,
              static_cast<long>(j["nan_capture_syncs_in_block"].get<int64_t>()), static_cast<long>(a.steps));
  std::printf("resnet50 b%ld bf16-mixed: nan_capture + spike (both) %.2f ms/step, overhead %+.2f%%, syncs %ld in %ld steps\n",
              static_cast<long>(a.batch), ms, (ms / mp - 1.0) * 100.0, static_cast<long>(j["spike_syncs_in_block"].get<int64_t>()),
              static_cast<long>(a.steps));
  if (!json_path.empty()) strobe::bench::write_json_atomic(json_path, j);
  return 0;
}
