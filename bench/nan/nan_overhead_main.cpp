// strobe_bench_nan: the NaN-capture overhead benchmark of issue 9 (a program, not a timed test).
// ResNet-50, batch 128, 20 classes, bf16-mixed, Adam lr 1e-4 (the seed's workload, as in
// shared/bench/pytorch_baselines.py nan), one GPU, through the trainer's own step path
// (Trainer::run_training_batch: batch transfer, forward, backward, StepPipeline, logging):
// the same model without callbacks and with nan_capture (check: both, action: stop), built in one
// process and interleaved in rounds of --steps steps; CUDA events around each block, the median
// per-step time over rounds is reported. Host batches are pinned, as the loader delivers them.
// Host syncs of the nan_capture run are counted with CUDA sync-debug mode "warn".
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "framework/config/config.h"
#include "framework/core/experiment_builder.h"

namespace {

struct Args {
  int64_t steps = 30, warmup = 15, rounds = 7, batch = 128;
  std::string json_path;
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

std::string yaml(int64_t batch, const std::string& callbacks) {
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

std::unique_ptr<strobe::Run> make(const Args& a, const std::string& callbacks) {
  auto doc = strobe::config::Document::load_string(yaml(a.batch, callbacks), "bench_nan.yaml");
  strobe::RunOptions o;
  o.create_run_dir = true;
  o.run_dir = "/tmp/strobe_bench_nan/" + std::string(callbacks.size() > 2 ? "nan_capture" : "plain");
  return strobe::build_run(doc, o);
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "strobe_bench_nan: needs a CUDA device\n");
    return 2;
  }
  auto plain = make(a, "[]");
  auto nan = make(a, "[{name: nan_capture}]");
  // Fixed host batches (pinned, as the loader delivers them); the same ones for both runs.
  std::vector<strobe::Batch> batches;
  torch::manual_seed(0);
  for (int i = 0; i < 8; ++i) {
    strobe::Batch b;
    b.tensors["image"] = torch::randn({a.batch, 3, 224, 224}).pin_memory();
    b.tensors["label"] = torch::randint(0, 20, {a.batch}, torch::kLong).pin_memory();
    b.meta["batch_size"] = a.batch;
    batches.push_back(b);
  }
  int64_t idx = 0;
  auto run_block = [&](strobe::Run& r, int64_t n) {
    for (int64_t i = 0; i < n; ++i, ++idx) r.trainer->run_training_batch(batches[idx % batches.size()], idx % 64);
  };
  run_block(*plain, a.warmup);
  run_block(*nan, a.warmup);
  torch::cuda::synchronize();

  std::vector<double> t_plain, t_nan;
  auto time_block = [&](strobe::Run& r) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    start.record();
    run_block(r, a.steps);
    stop.record();
    stop.synchronize();
    return start.elapsed_time(stop) / static_cast<double>(a.steps);
  };
  for (int64_t round = 0; round < a.rounds; ++round) {
    // Alternate the order so neither mode always runs first.
    if (round % 2 == 0) {
      t_plain.push_back(time_block(*plain));
      t_nan.push_back(time_block(*nan));
    } else {
      t_nan.push_back(time_block(*nan));
      t_plain.push_back(time_block(*plain));
    }
  }
  // Host syncs per step with nan_capture on (sync-debug "warn" + a counting handler).
  SyncCounter counter;
  auto* prev = c10::WarningUtils::get_warning_handler();
  c10::WarningUtils::set_warning_handler(&counter);
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  run_block(*nan, a.steps);
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  c10::WarningUtils::set_warning_handler(prev);
  torch::cuda::synchronize();

  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double mp = median(t_plain), mn = median(t_nan);
  nlohmann::json j = {{"workload", "resnet50 b" + std::to_string(a.batch) + " bf16-mixed adam, 20 classes"},
                      {"steps_per_round", a.steps},
                      {"rounds", a.rounds},
                      {"plain_step_ms", t_plain},
                      {"nan_capture_step_ms", t_nan},
                      {"plain_median_ms", mp},
                      {"nan_capture_median_ms", mn},
                      {"overhead_pct", (mn / mp - 1.0) * 100.0},
                      {"nan_capture_syncs_in_block", counter.count},
                      {"block_steps", a.steps}};
  std::printf("resnet50 b%ld bf16-mixed: plain %.2f ms/step, nan_capture %.2f ms/step, overhead %+.2f%%, syncs %ld in %ld steps\n",
              static_cast<long>(a.batch), mp, mn, (mn / mp - 1.0) * 100.0, static_cast<long>(counter.count),
              static_cast<long>(a.steps));
  if (!a.json_path.empty()) std::ofstream(a.json_path) << j.dump(2) << "\n";
  return 0;
}
