// The trainer on CUDA: every precision trains (fused and torch::optim optimizers), whole training
// steps with metrics, CSV + TensorBoard loggers and the progress bar make no host sync (sync-debug
// mode "error" for 60 consecutive steps spanning several log intervals), so do steps with NaN capture
// on for every precision, with gradient accumulation and clipping, a NaN on CUDA is captured and
// replays exactly (on CUDA, and on the CPU), and a CUDA checkpoint resumes on CPU with the losses of
// an uninterrupted run.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#ifdef STROBE_TORCH_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "strobe/core/callback.h"
#include "strobe/core/capture.h"
#include "strobe/core/master_weights.h"
#include "runner/replay.h"
#include "tests/cli/init_from_check.h"
#include "tests/gpu_trainer/cuda_skip.h"
#include "tests/trainer/trainer_test_util.h"
#include "tests/trainer/zero2_fixture_check.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

std::string cuda_yaml() {
  std::string y = tiny_yaml();
  y.replace(y.find("device: cpu"), 11, "device: cuda");
  return y;
}

#ifdef STROBE_TORCH_HAS_CUDA
// Turns sync-debug mode to "error" from training batch `from` on (default 2; the CUDA-graph tests
// start after the capture), and off for validation (whose epoch end may wait once, by design).
// Counts the training batches run under "error" in g_guarded_steps (shared with cuda_graphs_test.cpp).
}  // namespace
int64_t g_guarded_steps = 0;
namespace {
class SyncGuard : public Callback {
 public:
  explicit SyncGuard(int64_t from) : from_(from) {}
  std::string name() const override { return "sync_guard"; }
  void on_train_batch_start(TrainerView&, Module&, const Batch&, int64_t batch_idx) override {
    if (batch_idx >= from_) set(c10::cuda::SyncDebugMode::L_ERROR);
  }
  void on_train_batch_end(TrainerView&, Module&, const torch::Tensor&, const Batch&, int64_t batch_idx) override {
    if (batch_idx >= from_) ++g_guarded_steps;
  }
  void on_validation_start(TrainerView&, Module&) override { set(c10::cuda::SyncDebugMode::L_DISABLED); }
  void on_train_end(TrainerView&, Module&) override { set(c10::cuda::SyncDebugMode::L_DISABLED); }
  void on_exception(TrainerView&, Module&, const std::exception&) override { set(c10::cuda::SyncDebugMode::L_DISABLED); }

 private:
  static void set(c10::cuda::SyncDebugMode m) { c10::cuda::warning_state().set_sync_debug_mode(m); }
  int64_t from_;
};
std::shared_ptr<Callback> make_sync_guard(config::Section& cfg) {
  const int64_t from = cfg.get_int("from", 2, 0);
  cfg.finish();
  return std::make_shared<SyncGuard>(from);
}
STROBE_REGISTER(callback_registry(), "sync_guard", make_sync_guard);
#endif

}  // namespace

TEST(TrainerCuda, EveryPrecisionTrainsWithFusedAndTorchOptimizers) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const char* precision : {"32", "bf16-mixed", "16-mixed", "bf16-master"}) {
    for (const char* fused : {"true", "false"}) {
      std::string dir = temp_dir("cuda-precision");
      auto run = make_run(cuda_yaml(), {std::string("trainer.precision=") + precision, std::string("optimizer.fused=") + fused,
                                        "model.dropout=0.0", "trainer.max_epochs=3", "scheduler.max_steps=36"},
                          dir);
      ASSERT_EQ(run->trainer->fit(), 0) << precision << " fused=" << fused;
      EXPECT_EQ(run->trainer->view().state().global_step, 36);
      auto loss = read_csv(dir + "/metrics.csv", "train/loss");
      ASSERT_GE(loss.size(), 2u);
      double first = std::stod(loss.begin()->second["train/loss"]), last = std::stod(loss.rbegin()->second["train/loss"]);
      EXPECT_TRUE(std::isfinite(last)) << precision;
      EXPECT_LT(last, first) << precision << " fused=" << fused;
      EXPECT_GT(run->trainer->view().metrics().at("val/acc"), 0.5) << precision << " fused=" << fused;
    }
  }
}

TEST(TrainerCuda, TrainingStepsWithMetricsAndLoggersNeverSync) {
  SKIP_WITHOUT_CUDA_DEVICE();
#ifdef STROBE_TORCH_HAS_CUDA
  g_guarded_steps = 0;
  std::string yaml = R"(name: nosync
seed: 3
trainer:
  max_epochs: 1
  limit_train_batches: 64
  limit_val_batches: 2
  log_every_n_steps: 20
  precision: bf16-mixed
  gradient_clip_val: 1.0
  device: cuda
logger:
  csv: true
  tensorboard: true
model:
  name: resnet
  depth: 18
  num_classes: 100
  in_channels: 3
  width: 16
  stem: cifar
task:
  name: classification
  metrics: [accuracy, precision, recall, f1]
data:
  name: synthetic_images
  image_size: 32
  channels: 3
  num_classes: 100
  num_samples: 4096
  num_val_samples: 128
  batch_size: 64
  num_workers: 2
optimizer:
  name: adamw
  lr: 1.0e-3
scheduler:
  name: cosine
  warmup_steps: 5
callbacks:
  - name: sync_guard
  - name: progress_bar
    mode: plain
  - name: lr_monitor
  - name: model_checkpoint
    monitor: val/acc
    mode: max
)";
  std::string dir = temp_dir("nosync");
  auto run = make_run(yaml, {}, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  EXPECT_EQ(g_guarded_steps, 62);
  auto loss = read_csv(dir + "/metrics.csv", "train/loss");
  EXPECT_TRUE(loss.count(20) && loss.count(40) && loss.count(60)) << "log intervals inside the guarded window were not written";
  EXPECT_FALSE(read_csv(dir + "/metrics.csv", "val/f1").empty());
  bool tb = false;
  for (auto& e : std::filesystem::directory_iterator(dir)) tb |= e.path().filename().string().rfind("events.out.tfevents", 0) == 0;
  EXPECT_TRUE(tb);
#endif
}

TEST(TrainerCuda, CudaCheckpointResumesOnCpuWithTheLossesOfAnUninterruptedRun) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // No dropout: CUDA and CPU generators draw different masks; everything else must agree.
  std::string whole_dir = temp_dir("cuda-whole");
  auto whole = make_run(cuda_yaml(), {"model.dropout=0.0"}, whole_dir);
  ASSERT_EQ(whole->trainer->fit(), 0);
  std::string dir = temp_dir("cuda-ckpt");
  auto run = make_run(cuda_yaml(), {"trainer.max_steps=6", "model.dropout=0.0"}, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  std::string cpu_dir = temp_dir("cpu-resume");
  auto cpu = make_run(tiny_yaml(), {"model.dropout=0.0"}, cpu_dir, dir + "/checkpoints/last.ckpt");
  ASSERT_EQ(cpu->trainer->fit(std::move(cpu->checkpoint)), 0);
  EXPECT_EQ(cpu->trainer->view().state().global_step, 24);
  auto a = read_csv(whole_dir + "/metrics.csv", "train/loss");
  auto b = read_csv(cpu_dir + "/metrics.csv", "train/loss");
  int compared = 0;
  for (int64_t step = 7; step <= 24; ++step) {
    ASSERT_TRUE(a.count(step) && b.count(step)) << "step " << step;
    double x = std::stod(a[step]["train/loss"]), y = std::stod(b[step]["train/loss"]);
    EXPECT_NEAR(x, y, 1e-3 * std::max(1.0, std::abs(x))) << "step " << step;
    ++compared;
  }
  EXPECT_EQ(compared, 18);
}

#ifdef STROBE_TORCH_HAS_CUDA
std::string resnet_yaml(const std::string& callbacks, const std::string& loss = "cross_entropy", int64_t classes = 100) {
  return fmt::format(R"(name: nan_cuda
seed: 3
trainer:
  max_epochs: 1
  limit_train_batches: 24
  limit_val_batches: 0
  num_sanity_val_steps: 0
  log_every_n_steps: 5
  enable_checkpointing: false   # a checkpoint write is a deliberate sync; this test is about the steps
  device: cuda
model:
  name: resnet
  depth: 18
  num_classes: {0}
  in_channels: 3
  width: 16
  stem: cifar
task:
  name: classification
  loss: {1}
data:
  name: synthetic_images
  image_size: 32
  channels: 3
  num_classes: {0}
  num_samples: 4096
  num_val_samples: 128
  batch_size: {2}
  num_workers: 2
optimizer:
  name: adamw
  lr: 1.0e-3
scheduler:
  name: none
callbacks: {3}
)",
                     classes, loss, classes == 100 ? 64 : 8, callbacks);
}
#endif

TEST(TrainerCuda, NanCaptureStepsNeverSyncInEveryPrecisionWithAccumulationAndClipping) {
  SKIP_WITHOUT_CUDA_DEVICE();
#ifdef STROBE_TORCH_HAS_CUDA
  for (const char* precision : {"32", "bf16-mixed", "16-mixed", "bf16-master"}) {
    for (const char* accumulate : {"1", "2"}) {
      for (const char* clip : {"0.0", "1.0"}) {
        g_guarded_steps = 0;
        std::string dir = temp_dir("nan-nosync");
        auto run = make_run(resnet_yaml("[{name: sync_guard}, {name: nan_capture}]"),
                            {std::string("trainer.precision=") + precision,
                             std::string("trainer.accumulate_grad_batches=") + accumulate,
                             std::string("trainer.gradient_clip_val=") + clip},
                            dir);
        ASSERT_EQ(run->trainer->fit(), 0) << precision << " accumulate " << accumulate << " clip " << clip;
        EXPECT_EQ(g_guarded_steps, 22);
        auto loss = read_csv(dir + "/metrics.csv", "train/loss");
        ASSERT_FALSE(loss.empty());
        for (auto& [step, row] : loss) EXPECT_TRUE(std::isfinite(std::stod(row["train/loss"]))) << step;
        EXPECT_FALSE(std::filesystem::exists(dir + "/nan"));
      }
    }
  }
#endif
}

TEST(TrainerCuda, NanOnCudaIsCapturedAndReplaysExactlyOnCudaAndRunsOnCpu) {
  SKIP_WITHOUT_CUDA_DEVICE();
#ifdef STROBE_TORCH_HAS_CUDA
  for (const char* precision : {"32", "bf16-mixed"}) {
    std::string dir = temp_dir("nan-cuda");
    auto run = make_run(resnet_yaml("[{name: nan_capture}]", "per_class_bce", 4), {std::string("trainer.precision=") + precision}, dir);
    ASSERT_EQ(run->trainer->fit(), 3) << precision;
    auto report = capture::replay_capture(dir + "/nan", {});
    EXPECT_TRUE(report["exact"].get<bool>()) << report.dump(2);
    ASSERT_FALSE(report["first_nonfinite"].is_null()) << report.dump(2);
    EXPECT_EQ(report["first_nonfinite"]["op"], "aten::div") << report.dump(2);
    EXPECT_EQ(report["first_nonfinite"]["module"], "task.loss");
    capture::ReplayOptions on_cpu;
    on_cpu.device = "cpu";
    auto cpu = capture::replay_capture(dir + "/nan", on_cpu);
    EXPECT_EQ(cpu["replayed_on"], "cpu");
    ASSERT_FALSE(cpu["first_nonfinite"].is_null()) << cpu.dump(2);
    EXPECT_EQ(cpu["first_nonfinite"]["module"], "task.loss");
  }
#endif
}

// resnet18 at 2048 x 2048, batch 128: about 2 GiB of activations a sample, more than an H200 holds.
// `trainer_extra` goes into the trainer section.
std::string too_big_yaml(const std::string& trainer_extra, int workers = 8) {
  return R"(name: oom
trainer:
  max_steps: 2
  num_sanity_val_steps: 0
  enable_progress_bar: false
  device: cuda
)" + trainer_extra + R"(model:
  name: resnet
  depth: 18
  num_classes: 10
  in_channels: 3
data:
  name: synthetic_images
  image_size: 2048
  channels: 3
  num_classes: 10
  num_samples: 256
  num_val_samples: 8
  batch_size: 128
  num_workers: )" + std::to_string(workers) + "\n";
}

// A CUDA allocation failure in the middle of a run: one line naming the setting to lower, exit 1
// (the CPU twin of this test, under a ulimit, is tests/cli/hardening_test.cpp). The memory trial,
// which would refuse this batch before the run, is off.
TEST(TrainerCuda, RunningOutOfCudaMemoryNamesTheBatchSize) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const char* bin = std::getenv("STROBE_BIN");
  ASSERT_TRUE(bin != nullptr) << "STROBE_BIN must name the strobe executable (set by ctest)";
  std::string dir = temp_dir("cuda-oom");
  std::ofstream(dir + "/oom.yaml") << too_big_yaml("  memory_check: false\n");
  const std::string log = dir + "/oom.log";
  int raw = std::system((std::string(bin) + " fit -c " + dir + "/oom.yaml --run-dir " + dir + "/run > " + log + " 2>&1").c_str());
  std::ifstream in(log);
  std::string out((std::istreambuf_iterator<char>(in)), {});
  ASSERT_TRUE(WIFEXITED(raw)) << out;
  EXPECT_EQ(WEXITSTATUS(raw), 1) << out;
  EXPECT_NE(out.find("strobe: out of memory on cuda"), std::string::npos) << out;
  EXPECT_NE(out.find("lower data.batch_size (now 128)"), std::string::npos) << out;
  EXPECT_EQ(out.find("Exception raised from"), std::string::npos) << out;
}

// The same batch with the memory trial on (the default): refused before the run claims anything,
// one line naming data.batch_size, the measured estimate and the device's free memory, exit 2.
TEST(TrainerCuda, ABatchWhoseStepCannotFitOnTheDeviceIsRefusedBeforeAnyRunFile) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const char* bin = std::getenv("STROBE_BIN");
  ASSERT_TRUE(bin != nullptr) << "STROBE_BIN must name the strobe executable (set by ctest)";
  std::string dir = temp_dir("cuda-too-big");
  std::ofstream(dir + "/big.yaml") << too_big_yaml("", 1);  // few batches in host memory: the device is the limit
  const std::string log = dir + "/big.log";
  int raw = std::system((std::string(bin) + " fit -c " + dir + "/big.yaml --run-dir " + dir + "/run > " + log + " 2>&1").c_str());
  std::ifstream in(log);
  std::string out((std::istreambuf_iterator<char>(in)), {});
  ASSERT_TRUE(WIFEXITED(raw)) << out;
  EXPECT_EQ(WEXITSTATUS(raw), 2) << out;
  EXPECT_NE(out.find("data.batch_size: a training step on 128 samples needs about "), std::string::npos) << out;
  EXPECT_NE(out.find("of parameters and buffers"), std::string::npos) << out;
  EXPECT_NE(out.find(" of cuda:0 memory is free; lower data.batch_size"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  EXPECT_FALSE(std::filesystem::exists(dir + "/run"));
}

// The trial measures (a per-sample cost) and leaves the run as it was: with deterministic algorithms,
// a run with the trial ends with the weights of the run without it, bit for bit, for a model with
// dropout (the generator) and one with BatchNorm (its statistics).
TEST(TrainerCuda, TheMemoryTrialLeavesTheRunAsItWas) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const char* model : {"", "model={name: resnet, depth: 18, width: 8, num_classes: 4, in_channels: 1, stem: cifar}"}) {
    std::map<std::string, torch::Tensor> ends[2];
    for (int check = 0; check < 2; ++check) {
      std::vector<std::string> sets{"trainer.deterministic=true", "trainer.max_steps=6",
                                    std::string("trainer.memory_check=") + (check ? "true" : "false")};
      if (*model) sets.push_back(model);
      auto run = make_run(cuda_yaml(), sets, "");
      EXPECT_EQ(run->step_memory.has_value(), check == 1) << model;
      if (check) EXPECT_GT(run->step_memory->per_sample, 0) << model;
      ASSERT_EQ(run->trainer->fit(), 0) << model;
      ends[check] = params_of(*run->module);
    }
    ASSERT_EQ(ends[0].size(), ends[1].size());
    for (auto& [name, t] : ends[0]) EXPECT_TRUE(torch::equal(t, ends[1].at(name))) << model << " " << name;
  }
}

// model.init_from under the CUDA precisions and layouts (tests/cli/init_from_check.h): loaded before the
// device move, channels_last (memory_format auto = NHWC under bf16 on CUDA), the fused BatchNorm and
// bf16-master, so one lr-0 step leaves every saved parameter bit-equal to the file.
TEST(TrainerCuda, InitFromLoadsBeforeEveryPrecisionAndLayout) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const std::string resnet = "{name: resnet, depth: 18, width: 8, num_classes: 4, in_channels: 1, stem: cifar}";
  for (const char* precision : {"32", "bf16-mixed", "bf16-master", "16-mixed"})
    strobe::testing::expect_init_from_survives("cuda", precision, resnet);
}

// optimizer.param_groups on CUDA: the fused multi-tensor step with four groups of different lr and
// weight decay (no_decay auto, a head group) lands where torch::optim's step lands, in fp32 and under
// bf16-master (the groups hold the fp32 masters).
// A zero2 checkpoint two ranks wrote on the CPU (tests/fixtures/zero2) resumes in one process on the
// GPU, its shards re-cut into a whole optimizer state, ending on a straight GPU run's weights
// (fp32 on CUDA against the fixture's CPU steps: 1e-4).
TEST(TrainerCuda, AZero2CheckpointOfTwoRanksResumesInOneProcessOnTheGpu) {
  SKIP_WITHOUT_CUDA_DEVICE();
  strobe::testing::expect_zero2_fixture_resumes("cuda", 1e-4);
}

// The host-side build of bf16-master under zero2 (strobe/core/master_weights.h): from a model on the
// host, the GPU receives the bf16 parameters, rounded as a conversion on the GPU rounds them, and the
// allocator's peak is their bytes plus at most one parameter's fp32 transient (a whole fp32 model on
// the GPU would be twice the bf16 bytes); the fp32 masters stay on the host.
TEST(TrainerCuda, TheHostSideBuildSendsTheGpuTheBf16WeightsOnly) {
  SKIP_WITHOUT_CUDA_DEVICE();
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(1024, 4096), torch::nn::GELU(), torch::nn::Linear(4096, 1024),
                            torch::nn::LayerNorm(torch::nn::LayerNormOptions({1024})));
  std::vector<torch::Tensor> host;
  int64_t bf16_bytes = 0, largest = 0;
  for (const auto& p : net->parameters()) {
    host.push_back(p.detach().clone());
    bf16_bytes += p.numel() * 2;
    largest = std::max<int64_t>(largest, p.numel() * 4);
  }
  torch::zeros({1}, torch::kCUDA);  // the caching allocator exists before its statistics are read
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  const auto before = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
  MasterWeights masters(*net, torch::kBFloat16, torch::Device(torch::kCUDA, 0));
  torch::cuda::synchronize();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  EXPECT_EQ(stats.allocated_bytes[0].current - before, bf16_bytes);
  EXPECT_LE(stats.allocated_bytes[0].peak - before, bf16_bytes + largest);
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(params[i].is_cuda()) << i;
    EXPECT_EQ(params[i].scalar_type(), torch::kBFloat16) << i;
    EXPECT_TRUE(torch::equal(params[i].cpu(), host[i].to(torch::kCUDA).to(torch::kBFloat16).cpu())) << i;
    EXPECT_TRUE(masters.master_of(params[i]).device().is_cpu()) << i;
    EXPECT_TRUE(torch::equal(masters.master_of(params[i]), host[i])) << i;
  }
}

TEST(TrainerCuda, FusedStepWithParamGroupsEqualsTorchOptim) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const char* precision : {"32", "bf16-master"}) {
    std::map<std::string, std::map<std::string, torch::Tensor>> weights;
    for (const char* fused : {"true", "false"}) {
      std::string dir = temp_dir("cuda-groups");
      auto run = make_run(cuda_yaml(), {std::string("trainer.precision=") + precision, std::string("optimizer.fused=") + fused,
                                        "model.dropout=0.0", "trainer.max_steps=5", "optimizer.weight_decay=0.1",
                                        "optimizer.param_groups={no_decay: auto, groups: [{params: 'head.*', lr: 0.05, weight_decay: 0.3}]}"},
                          dir);
      ASSERT_EQ(run->trainer->fit(), 0) << precision << " fused=" << fused;
      EXPECT_EQ(run->trainer->view().param_group_names().size(), 4u);
      for (auto& [k, v] : model_tensors(dir + "/checkpoints/last.ckpt")) weights[fused][k] = v.to(torch::kFloat64);
    }
    ASSERT_FALSE(weights["true"].empty());
    for (auto& [k, v] : weights["true"]) {
      const auto& ref = weights["false"].at(k);
      const double rel = (v - ref).abs().max().item<double>() / std::max(ref.abs().max().item<double>(), 1e-12);
      EXPECT_LT(rel, 1e-5) << precision << " " << k;
      EXPECT_FALSE(std::isnan(rel)) << k;
    }
  }
}
