// Forensics under `attention: math`: the infinities the math path means (the reference's +inf LSE
// of full_like, a causal mask's masked_fill of -inf, the masked scores less their maximum) are never
// the first non-finite value; a real one still is. A ViT run with one outlier target gets the same
// replay, diagnose verdict and bisected sample with math attention as with sdpa.
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "runner/replay.h"
#include "strobe/checkpoint/safetensors.h"
#include "strobe/core/forensics.h"
#include "strobe/core/module.h"
#include "tests/trainer/trainer_test_util.h"

namespace strobe {
namespace {

using testing::temp_dir;

// A step of a tiny vit (math attention) and of a tiny llama (math attention, causal) traced whole:
// finite, nothing is reported; with one NaN in a weight, its module is named.
TEST(MathAttentionForensics, IntendedInfinitiesAreNotFindingsAndARealOneIsNamed) {
  const std::string vit = R"(name: v
trainer: {device: cpu}
model: {name: vit, img_size: 8, patch_size: 4, in_channels: 1, num_classes: 3, embed_dim: 16, depth: 1, num_heads: 2, attention: math}
data: {name: synthetic_images, image_size: 8, channels: 1, num_classes: 3, num_samples: 16, batch_size: 4, num_workers: 0}
)";
  const std::string llama = R"(name: l
trainer: {device: cpu}
model: {name: llama, vocab_size: 64, embed_dim: 32, depth: 1, num_heads: 4, max_seq_len: 16, attention: math, fused_ops: false}
data: {name: synthetic_tokens, vocab_size: 64, max_seq_len: 16, num_samples: 16, batch_size: 4, num_workers: 0}
)";
  for (const auto& [yaml, poisoned] : {std::pair{vit, std::string("blocks.0.fc1.weight")},
                                       std::pair{llama, std::string("layers.0.mlp.gate_proj.weight")}}) {
    auto run = testing::make_run(yaml, {}, "");
    run->datamodule->setup(Stage::Fit);
    const Batch batch = run->datamodule->train_loader()->make_batch(0, 0);
    auto& net = run->module->net();
    {
      NonFiniteTracer tracer(net);
      run->module->training_step(batch, 0).backward();
      EXPECT_GT(tracer.ops_observed(), 20);
      const auto first = tracer.first();
      EXPECT_FALSE(first.has_value()) << poisoned << ": " << first->to_json().dump(2);
    }
    {
      torch::NoGradGuard ng;
      net.named_parameters()[poisoned].view(-1)[3] = std::numeric_limits<float>::quiet_NaN();
    }
    NonFiniteTracer tracer(net);
    run->module->training_step(batch, 0).backward();
    const auto first = tracer.first();
    ASSERT_TRUE(first.has_value()) << poisoned;
    EXPECT_EQ(first->module + ".weight", poisoned) << first->to_json().dump(2);
    EXPECT_EQ(first->phase, "forward");
  }
}

// One outlier regression target (dataset index 37, batch 4) spikes the loss: the spike capture's
// replay finds nothing non-finite, diagnose says "data" and bisect names sample 37, under math
// attention as under sdpa (math's own masks used to be reported as the first non-finite value, and
// the verdict was "weights").
TEST(MathAttentionForensics, AnOutlierTargetIsDataAndItsSampleOnEveryAttentionPath) {
  const std::string dir = temp_dir("math-forensics");
  torch::manual_seed(0);
  auto y = torch::randn({64, 1});
  y[37][0] = 1e4;
  safetensors::write_file(dir + "/d.safetensors", {{"x", torch::randn({64, 1, 8, 8})}, {"y", y}});
  const std::string yaml = R"(name: outlier
seed: 1
trainer: {max_steps: 8, device: cpu, enable_progress_bar: false, num_sanity_val_steps: 0}
model: {name: vit, img_size: 8, patch_size: 4, in_channels: 1, num_classes: 1, embed_dim: 16, depth: 1, num_heads: 2}
task: {name: regression, loss: mse}
data: {name: tensor_file, path: )" + dir + R"(/d.safetensors, fields: {image: x, target: y}, shuffle: false, batch_size: 8,
       num_workers: 0}
optimizer: {name: adamw, lr: 0.001}
callbacks: [{name: nan_capture, spike: {window: 16, warmup: 4}}]
)";
  for (const std::string attention : {"sdpa", "math"}) {
    const std::string run_dir = dir + "/" + attention;
    {
      auto run = testing::make_run(yaml, {"model.attention=" + attention}, run_dir);
      ::testing::internal::CaptureStderr();
      const int rc = run->trainer->fit();
      const std::string err = ::testing::internal::GetCapturedStderr();
      ASSERT_EQ(rc, 3) << attention << "\n" << err;
    }
    const auto replay = capture::replay_capture(run_dir + "/nan", {});
    EXPECT_TRUE(replay["first_nonfinite"].is_null()) << attention << replay.dump(2);
    const auto diagnosis = capture::diagnose_capture(run_dir + "/nan", {});
    EXPECT_EQ(diagnosis["verdict"], "data") << attention << diagnosis.dump(2);
    const auto bisection = capture::bisect_capture(run_dir + "/nan", {});
    ASSERT_EQ(bisection["samples"].size(), 1u) << attention << bisection.dump(2);
    EXPECT_EQ(bisection["samples"][0]["dataset_index"], 37) << attention << bisection.dump(2);
  }
}

}  // namespace
}  // namespace strobe
