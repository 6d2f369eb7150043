// CUDA checks of the models, attention backends and the GIoU reference (skip without a GPU).
#include <gtest/gtest.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "framework/data/collate_tokens.h"
#include "models/attention.h"
#include "tasks/giou_reference.h"
#include "tests/models/model_test_util.h"

namespace strobe {
namespace {

#define REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible"

using models::AttentionBackend;

TEST(GpuAttention, SdpaMatchesMathInBf16PaddedAndPacked) {
  REQUIRE_CUDA();
  torch::manual_seed(0);
  auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  auto q = torch::randn({4, 197, 16, 64}, opts), k = torch::randn({4, 197, 16, 64}, opts), v = torch::randn({4, 197, 16, 64}, opts);
  for (bool causal : {false, true}) {
    auto a = models::attention(q, k, v, causal, std::nullopt, AttentionBackend::Math).to(torch::kFloat32);
    auto b = models::attention(q, k, v, causal, std::nullopt, AttentionBackend::Sdpa).to(torch::kFloat32);
    EXPECT_LT((a - b).abs().max().item<double>(), 3e-2) << "causal=" << causal;
  }
  // Packed: the FlashAttention varlen path vs the math reference.
  auto cu = torch::tensor({0, 100, 101, 357, 1000}, torch::TensorOptions().dtype(torch::kInt32).device(torch::kCUDA));
  auto qp = torch::randn({1000, 16, 64}, opts).requires_grad_(), kp = torch::randn({1000, 16, 64}, opts), vp = torch::randn({1000, 16, 64}, opts);
  auto a = models::attention_varlen(qp, kp, vp, cu, 643, true, AttentionBackend::Math);
  auto b = models::attention_varlen(qp, kp, vp, cu, 643, true, AttentionBackend::Sdpa);
  EXPECT_LT((a.to(torch::kFloat32) - b.to(torch::kFloat32)).abs().max().item<double>(), 3e-2);
  b.to(torch::kFloat32).sum().backward();
  EXPECT_TRUE(torch::isfinite(qp.grad()).all().item<bool>());
}

TEST(GpuModels, EveryModelTrainsAStepInBf16Autocast) {
  REQUIRE_CUDA();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{name: resnet, depth: 50, num_classes: 20}", "image"},
      {"{name: vit, img_size: 224, patch_size: 16, embed_dim: 256, depth: 2, num_heads: 4, class_token: false, global_pool: avg, attention: sdpa}", "image"},
      {"{name: face_detector, image_size: 256, hidden_dim: 1024}", "boxes"},
  };
  for (const auto& [yaml, kind] : cases) {
    auto m = testing::build_model(yaml);
    m->to(torch::kCUDA);
    Batch b;
    b.tensors["image"] = kind == "boxes" ? torch::randint(0, 256, {8, 1, 256, 256}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA))
                                         : torch::randn({8, 3, 224, 224}, torch::kCUDA);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    auto y = m->forward(b);
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    y.to(torch::kFloat32).sum().backward();
    for (const auto& p : m->parameters()) ASSERT_TRUE(torch::isfinite(p.grad()).all().item<bool>()) << yaml;
  }
}

TEST(GpuModels, DecoderLMPaddedAndPackedLossesAgreeWithSdpa) {
  REQUIRE_CUDA();
  torch::manual_seed(0);
  auto m = testing::build_model("{name: decoder_lm, vocab_size: 128, max_seq_len: 256, embed_dim: 128, depth: 2, num_heads: 2, attention: sdpa}");
  m->to(torch::kCUDA, torch::kBFloat16);
  std::vector<Sample> samples = testing::token_samples({17, 255, 1, 128}, 128);
  auto loss = [&](const Batch& b) {
    auto d = b.to(torch::kCUDA);
    auto logits = m->forward(d).to(torch::kFloat32);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, 128}), d.at("targets").reshape({-1}),
                                                torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100))
        .item<double>();
  };
  const double padded = loss(data::collate_tokens_padded(samples, 256)), packed = loss(data::collate_tokens_packed(samples));
  EXPECT_NEAR(padded, packed, 2e-2);
}

TEST(GpuGIoU, ReferenceOnCudaMatchesCpu) {
  REQUIRE_CUDA();
  auto tl = torch::rand({64, 256, 2}) * 200, pred = torch::cat({tl, tl + 1 + torch::rand({64, 256, 2}) * 50}, -1);
  auto target = torch::cat({tl + 3, tl + 20}, -1) * (torch::rand({64, 256, 1}) < 0.1).to(torch::kFloat32);
  auto cpu = tasks::giou_loss_padded_reference(pred, target);
  auto gpu = tasks::giou_loss_padded_reference(pred.cuda().to(torch::kBFloat16), target.cuda());
  EXPECT_NEAR(cpu.item<double>(), gpu.item<double>(), 2e-2);
}

}  // namespace
}  // namespace strobe
