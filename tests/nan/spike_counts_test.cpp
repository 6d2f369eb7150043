// What nan_capture.spike's window and warm-up count (docs/CONFIG.md, "nan_capture"): optimizer steps.
// With warmup equal to window the first step checked is step window + 1; under accumulation a spike
// in a batch before warmup x k batches is not checked, and one after is.
#include <gtest/gtest.h>

#include <string>

#include <torch/torch.h>

#include "strobe/checkpoint/safetensors.h"
#include "tests/trainer/trainer_test_util.h"

namespace strobe {
namespace {

// A regression file whose target at dataset index `outlier` is 30 (batches of 8, in order; one epoch).
std::string outlier_yaml(const std::string& dir, int64_t outlier) {
  torch::manual_seed(0);
  auto y = torch::randn({128, 1});
  y[outlier][0] = 30;
  safetensors::write_file(dir + "/d.safetensors", {{"x", torch::randn({128, 4})}, {"y", y}});
  return R"(name: spike_counts
seed: 1
trainer: {max_epochs: 1, device: cpu, enable_progress_bar: false, num_sanity_val_steps: 0, enable_checkpointing: false}
model: {name: mlp, in_features: 4, hidden: [8], num_classes: 1}
task: {name: regression, loss: mse}
data: {name: tensor_file, path: )" + dir + R"(/d.safetensors, fields: {image: x, target: y}, shuffle: false, batch_size: 8,
       num_workers: 0}
optimizer: {name: sgd, lr: 0.001}
)";
}

int fit_rc(const std::string& yaml, const std::vector<std::string>& sets, const std::string& dir) {
  auto run = testing::make_run(yaml, sets, dir);
  ::testing::internal::CaptureStderr();
  const int rc = run->trainer->fit();
  ::testing::internal::GetCapturedStderr();
  return rc;
}

TEST(NanCaptureSpike, WindowAndWarmupCountOptimizerSteps) {
  const std::string dir = testing::temp_dir("spike-counts");
  // The outlier in batch 4 (rows 32-39): step 5 without accumulation.
  const std::string yaml = outlier_yaml(dir, 37);
  const std::string spike4 = "callbacks=[{name: nan_capture, spike: {window: 4, warmup: 4, zscore: 50}}]";
  EXPECT_EQ(fit_rc(yaml, {spike4}, dir + "/equal"), 3) << "warmup = window = 4: step 5 is checked";
  // Under accumulate_grad_batches 2 batch 4 is in step 3, before 4 accepted steps: not checked.
  EXPECT_EQ(fit_rc(yaml, {spike4, "trainer.accumulate_grad_batches=2"}, dir + "/accumulated"), 0);
  // The same outlier in batch 12 (step 7 under accumulation 2): checked, captured.
  const std::string later = outlier_yaml(dir, 8 * 12 + 5);
  EXPECT_EQ(fit_rc(later, {spike4, "trainer.accumulate_grad_batches=2"}, dir + "/accumulated_later"), 3);
}

}  // namespace
}  // namespace strobe
