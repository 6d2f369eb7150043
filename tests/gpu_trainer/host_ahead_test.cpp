// "No host sync", proved on the device itself: sync-debug mode (the other GPU tests) does not see
// cudaEventSynchronize / cudaDeviceSynchronize or an allocation that waits for the device. Here a
// callback holds the compute stream with a spin kernel (~2 s) at one training batch and records an
// event behind it; the host must then finish several whole training steps — forward, backward,
// optimizer, logging to CSV and TensorBoard every step, the progress bar, lr_monitor, NaN capture's
// ring — while that event is still pending. Any wait for the device in the step path would let the
// spin end first; NaN capture's designed bound (it reads a verdict once keep_last steps are
// outstanding) must stop the host there. Run eagerly and under trainer.cuda_graphs (the gate after
// the capture).
#include <gtest/gtest.h>

#include <chrono>

#ifdef STROBE_TORCH_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Sleep.h>
#endif

#include <fmt/format.h>

#include "strobe/core/callback.h"
#include "strobe/core/throughput.h"
#include "strobe/core/trainer_view.h"
#include "tests/gpu_trainer/cuda_skip.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

#ifdef STROBE_TORCH_HAS_CUDA
// At training batch `at`: a spin kernel on the current stream, then an event behind it. Counts the
// training steps whose end the host reached while that event was pending.
class SpinGate : public Callback {
 public:
  explicit SpinGate(int64_t at) : at_(at) {}
  std::string name() const override { return "spin_gate"; }
  void on_train_batch_start(TrainerView&, Module&, const Batch&, int64_t batch_idx) override {
    if (batch_idx != at_) return;
    at::cuda::sleep(kSpinCycles);
    gate_.record(at::cuda::getCurrentCUDAStream());
    gated_ = true;
    start_ = std::chrono::steady_clock::now();
  }
  void on_train_batch_complete(TrainerView& t, Module&) override {
    if (!gated_ || released_) return;
    if (gate_.query()) {
      released_ = true;
      return;
    }
    ++ahead_;
    last_step_ahead_ = t.state().global_step;
    host_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  static constexpr int64_t kSpinCycles = 4'000'000'000;  // ~2 s at an H100's clock
  int64_t ahead_ = 0, last_step_ahead_ = 0;
  double host_s_ = 0;
  bool released_ = false;

 private:
  int64_t at_;
  bool gated_ = false;
  at::cuda::CUDAEvent gate_;
  std::chrono::steady_clock::time_point start_;
};
#endif

// `monitors`: the everyday callbacks on as well, each at every step (the most it can do in a step).
std::string host_ahead_yaml(const std::string& graphs, bool monitors) {
  return fmt::format(R"(name: host-ahead
seed: 11
trainer:
  max_epochs: 1
  limit_train_batches: 40
  limit_val_batches: 2
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  precision: bf16-mixed
  gradient_clip_val: 1.0
  cuda_graphs: {}
  device: cuda
logger:
  csv: true
  tensorboard: true
model:
  name: mlp
  in_features: 192
  hidden: [256, 128]
  num_classes: 10
  dropout: 0.1
task:
  name: classification
  metrics: [accuracy, f1]
data:
  name: synthetic_images
  image_size: 8
  channels: 3
  num_classes: 10
  num_samples: 2560
  num_val_samples: 64
  batch_size: 64
  num_workers: 2
optimizer:
  name: adamw
  lr: 1.0e-3
scheduler:
  name: cosine
  warmup_steps: 5
callbacks:
  - name: nan_capture
    keep_last: 8
  - name: lr_monitor
  - name: progress_bar
    mode: plain
)",
                     graphs) +
         (monitors ? "  - name: throughput_monitor\n    every_n_steps: 1\n  - name: device_stats_monitor\n    every_n_steps: 1\n"
                     "  - name: model_summary\n    max_depth: -1\n  - name: on_exception_checkpoint\n  - name: ema\n"
                   : "");
}

}  // namespace

TEST(HostAheadCuda, TheHostFinishesSeveralWholeStepsWhileTheDeviceIsHeldEagerAndGraphed) {
  SKIP_WITHOUT_CUDA_DEVICE();
#ifdef STROBE_TORCH_HAS_CUDA
  // NaN capture reads a step's verdict once more than `keep_last` (8) steps are outstanding: that
  // is the one designed wait. The gated step's ring may still hold a step or two from before the
  // gate (their copies landed or not), so the host gets 6 to 8 whole steps ahead, never more.
  constexpr int64_t kGateAt = 20, kAtLeast = 6, kKeepLast = 8;
  for (const auto& [graphs, monitors] : std::vector<std::pair<std::string, bool>>{{"false", false}, {"true", false}, {"true", true}}) {
    std::string dir = temp_dir("host-ahead-" + graphs + (monitors ? "-monitors" : ""));
    auto gate = std::make_shared<SpinGate>(kGateAt);
    auto run = make_run(host_ahead_yaml(graphs, monitors), {}, dir, std::nullopt, {gate});
    ASSERT_EQ(run->trainer->fit(), 0) << graphs;
    std::cout << fmt::format("[ host_ahead ] cuda_graphs {}{}: {} whole steps ended while the device spun (steps {}..{}, "
                             "{:.3f} s of host time)\n",
                             graphs, monitors ? " with the monitors" : "", gate->ahead_, kGateAt + 1, gate->last_step_ahead_, gate->host_s_);
    EXPECT_GE(gate->ahead_, kAtLeast) << "cuda_graphs " << graphs << ": the host waited for the device inside the step path";
    EXPECT_LE(gate->ahead_, kKeepLast) << "cuda_graphs " << graphs << ": NaN capture's bound (keep_last) no longer holds";
    EXPECT_TRUE(gate->released_) << graphs;
    if (graphs == "true") {
      EXPECT_EQ(run->trainer->graph_counts().captures, 1);
      EXPECT_GE(run->trainer->graph_counts().replays, 30);
    }
    auto loss = read_csv(dir + "/metrics.csv", "train/loss");
    for (int64_t step = kGateAt + 1; step <= kGateAt + kAtLeast; ++step)
      EXPECT_TRUE(loss.count(step)) << graphs << ": step " << step << "'s row is missing from metrics.csv";
    if (monitors) {
      // Every step's window was logged, the gated ones too (once their events completed), with the
      // utilisation of a device in the dense-peak table; the allocator's counters on every step.
      const auto mfu = read_csv(dir + "/metrics.csv", "throughput/mfu");
      const auto allocated = read_csv(dir + "/metrics.csv", "device_stats/allocated_gib");
      EXPECT_EQ(mfu.size(), 40u) << "throughput/mfu rows (the device: " << strobe::device_name(torch::Device("cuda")) << ")";
      EXPECT_EQ(allocated.size(), 40u);
      for (const auto& kv : mfu) {
        const double u = std::stod(kv.second.at("throughput/mfu"));
        EXPECT_GT(u, 0) << kv.first;
        EXPECT_LT(u, 1) << kv.first;
      }
      for (const auto& kv : allocated) EXPECT_GT(std::stod(kv.second.at("device_stats/allocated_gib")), 0) << kv.first;
      EXPECT_TRUE(std::filesystem::exists(dir + "/model_summary.txt"));
    }
  }
#endif
}
