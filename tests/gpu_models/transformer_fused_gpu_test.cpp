// Training check of model.fused_ops + task.fused_loss on the GPU: vit and decoder_lm with bf16
// parameters and activations (as precision bf16-master runs them, no autocast), the fused kernels on
// vs ATen (vit with gelu: tanh, so its MLP runs as strobe::fused_mlp), from the same initial weights on the same batches, 40 AdamW steps each. The two loss
// curves must agree within bf16 noise at every step and both must learn.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/module.h"
#include "strobe/data/collate_tokens.h"
#include "strobe/ops/ops.h"
#include "tests/models/model_test_util.h"

namespace strobe {
namespace {

#define REQUIRE_CUDA_KERNELS()                                                        \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";         \
  if (!ops::built_with_cuda()) GTEST_SKIP() << "strobe_ops built without CUDA kernels"

std::shared_ptr<Module> build_task(const std::string& yaml, std::shared_ptr<Model> model) {
  auto doc = config::Document::load_string(yaml, "task.yaml");
  auto section = doc.root();
  return task_registry().create(section, "", model);
}

std::vector<double> train(const std::string& model_yaml, const std::string& task_yaml, Model& init,
                          const std::vector<Batch>& batches, int steps) {
  auto model = testing::build_model(model_yaml);
  testing::copy_weights(init, *model);
  model->to(torch::kCUDA, torch::kBFloat16);
  auto task = build_task(task_yaml, model);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.0).eps(1e-6));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::Tensor l = task->training_step(batches[s % batches.size()], s);
    l.backward();
    opt.step();
    losses.push_back(l.item<double>());
  }
  return losses;
}

void expect_same_curve(const std::vector<double>& on, const std::vector<double>& off, const char* what) {
  ASSERT_EQ(on.size(), off.size());
  double max_rel = 0;
  for (size_t i = 0; i < on.size(); ++i) {
    ASSERT_TRUE(std::isfinite(on[i]) && std::isfinite(off[i])) << what << " step " << i;
    max_rel = std::max(max_rel, std::abs(on[i] - off[i]) / std::abs(off[i]));
  }
  std::cout << what << ": loss " << off.front() << " -> " << off.back() << " (ATen), " << on.front() << " -> "
            << on.back() << " (fused); max relative difference " << max_rel << "\n";
  // bf16 noise: the first step's difference is rounding only; later ones compound through AdamW.
  EXPECT_LT(std::abs(on[0] - off[0]) / std::abs(off[0]), 1e-2) << what;
  EXPECT_LT(max_rel, 5e-2) << what;
  EXPECT_LT(off.back(), 0.9 * off.front()) << what << ": ATen run did not learn";
  EXPECT_LT(on.back(), 0.9 * on.front()) << what << ": fused run did not learn";
}

TEST(GpuFusedOps, VitLossCurveMatchesAten) {
  REQUIRE_CUDA_KERNELS();
  torch::manual_seed(31);
  const std::string m = "{name: vit, img_size: 64, patch_size: 8, num_classes: 10, embed_dim: 256, depth: 4, num_heads: 4, attention: custom, gelu: tanh, fused_ops: ";
  auto init = testing::build_model(m + "false}");
  std::vector<Batch> batches;
  for (int i = 0; i < 2; ++i) {
    Batch b = testing::image_batch(torch::randn({32, 3, 64, 64}).to(torch::kCUDA, torch::kBFloat16));
    b.tensors["label"] = torch::randint(0, 10, {32}, torch::kLong).to(torch::kCUDA);
    batches.push_back(b);
  }
  const auto off = train(m + "false}", "{name: classification, fused_loss: false}", *init, batches, 40);
  const auto on = train(m + "true}", "{name: classification, fused_loss: true}", *init, batches, 40);
  expect_same_curve(on, off, "vit");
}

TEST(GpuFusedOps, DecoderLmLossCurveMatchesAten) {
  REQUIRE_CUDA_KERNELS();
  torch::manual_seed(32);
  const std::string m = "{name: decoder_lm, vocab_size: 256, max_seq_len: 128, embed_dim: 256, depth: 4, num_heads: 4, attention: custom, fused_ops: ";
  auto init = testing::build_model(m + "false}");
  std::vector<Batch> batches;
  for (int i = 0; i < 2; ++i) {
    std::vector<Sample> samples = testing::token_samples({100, 37, 128, 64, 90, 11, 128, 75}, 256);
    Batch b = data::collate_tokens_packed(samples);
    for (auto& kv : b.tensors) kv.second = kv.second.to(torch::kCUDA);
    batches.push_back(b);
  }
  const auto off = train(m + "false}", "{name: language_modeling, fused_loss: false}", *init, batches, 40);
  const auto on = train(m + "true}", "{name: language_modeling, fused_loss: true}", *init, batches, 40);
  expect_same_curve(on, off, "decoder_lm");
}

// task.fused_linear_loss on the GPU, llama with bf16 weights: auto takes the fused head
// (strobe::linear_cross_entropy) at a vocabulary of 32,768 tokens and the logits path below it: the
// loss and every gradient equal those of `true` (resp. `false`) bit for bit. The fused head's gradients
// are the logits path's within bf16 rounding, and 40 AdamW steps of each give the same curve.
TEST(GpuFusedOps, FusedLinearLossAutoFollowsTheVocabularyAndMatchesTheLogitsPath) {
  REQUIRE_CUDA_KERNELS();
  torch::manual_seed(33);
  auto grads_of = [](const std::string& task_yaml, Model& init, const std::string& model_yaml, const Batch& batch) {
    auto model = testing::build_model(model_yaml);
    testing::copy_weights(init, *model);
    model->to(torch::kCUDA, torch::kBFloat16);
    auto task = build_task(task_yaml, model);
    torch::Tensor l = task->training_step(batch, 0);
    l.backward();
    std::vector<torch::Tensor> out{l.detach()};
    for (auto& p : model->parameters()) out.push_back(p.grad());
    return out;
  };
  auto same = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    for (size_t i = 0; i < a.size(); ++i)
      if (!torch::equal(a[i], b[i])) return false;
    return true;
  };
  for (const int64_t vocab : {32768, 32767}) {
    SCOPED_TRACE(vocab);
    const std::string m = "{name: llama, vocab_size: " + std::to_string(vocab) +
                          ", embed_dim: 64, depth: 1, num_heads: 4, num_kv_heads: 2, ffn_dim: 96, max_seq_len: 64}";
    auto init = testing::build_model(m);
    std::vector<Sample> samples = testing::token_samples({64, 40, 64, 23}, vocab);
    Batch batch = data::collate_tokens_packed(samples);
    for (auto& kv : batch.tensors) kv.second = kv.second.to(torch::kCUDA);
    const auto a = grads_of("{name: language_modeling}", *init, m, batch);
    const auto on = grads_of("{name: language_modeling, fused_linear_loss: true}", *init, m, batch);
    const auto off = grads_of("{name: language_modeling, fused_linear_loss: false}", *init, m, batch);
    if (vocab >= 32768) {
      EXPECT_TRUE(same(a, on)) << "auto takes the fused head";
      EXPECT_FALSE(same(a, off));
    } else {
      EXPECT_TRUE(same(a, off)) << "auto takes the logits path";
      EXPECT_FALSE(same(a, on));
    }
    for (size_t i = 0; i < on.size(); ++i) {
      const double rel = ((on[i].to(torch::kDouble) - off[i].to(torch::kDouble)).norm() /
                          off[i].to(torch::kDouble).norm()).item<double>();
      EXPECT_LT(rel, 1.5e-2) << "tensor " << i << " (0: the loss)";
    }
  }
  const std::string m = "{name: llama, vocab_size: 32768, embed_dim: 64, depth: 2, num_heads: 4, num_kv_heads: 2, "
                        "ffn_dim: 96, max_seq_len: 64, tie_embeddings: true}";
  auto init = testing::build_model(m);
  std::vector<Batch> batches;
  for (int i = 0; i < 2; ++i) {
    std::vector<Sample> samples = testing::token_samples({64, 37, 64, 50, 11, 64}, 512);
    Batch b = data::collate_tokens_packed(samples);
    for (auto& kv : b.tensors) kv.second = kv.second.to(torch::kCUDA);
    batches.push_back(b);
  }
  const auto off = train(m, "{name: language_modeling, fused_linear_loss: false}", *init, batches, 40);
  const auto on = train(m, "{name: language_modeling, fused_linear_loss: true}", *init, batches, 40);
  expect_same_curve(on, off, "llama fused_linear_loss");
}

}  // namespace
}  // namespace strobe
