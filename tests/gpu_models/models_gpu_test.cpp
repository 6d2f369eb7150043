// CUDA checks of the models, attention backends and the GIoU reference (skip without a GPU).
#include <gtest/gtest.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "strobe/core/activation_checkpoint.h"
#include "strobe/data/collate_tokens.h"
#include "strobe/ops/cuda_graph.h"
#include "models/attention.h"
#include "tasks/giou_reference.h"
#include "tests/models/model_test_util.h"

namespace strobe {
namespace {

#define REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible"

using models::AttentionBackend;

// A checkpointed block with dropout on CUDA: with preserve_rng the recompute draws the forward's mask
// from the CUDA generator (bitwise the gradients of the block run plainly); under CUDA graph capture
// the generator's state cannot be read, and the capture fails saying so.
TEST(GpuActivationCheckpointing, DropoutOnCudaRecomputesTheSameMaskAndRefusesGraphCapture) {
  REQUIRE_CUDA();
  auto fc = torch::nn::Linear(64, 64);
  fc->to(torch::kCUDA);
  auto fn = [layer = fc.ptr()](const std::vector<torch::Tensor>& t) {
    return std::vector<torch::Tensor>{t[0] + torch::dropout(torch::gelu(layer->forward(t[0])), 0.5, true)};
  };
  torch::manual_seed(1);
  const auto x0 = torch::randn({32, 64}, torch::kCUDA);
  auto run = [&](bool checkpointed) {
    fc->zero_grad();
    auto x = x0.clone().requires_grad_(true);
    torch::manual_seed(5);
    auto y = checkpointed ? checkpoint_block(*fc, {x}, fn)[0] : fn({x})[0];
    torch::randn({1000}, torch::kCUDA);  // the generator moves on before backward
    (y * y).sum().backward();
    return std::vector<torch::Tensor>{x.grad(), fc->weight.grad()};
  };
  const auto want = run(false), got = run(true);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::equal(want[i], got[i])) << i;

  ops::CudaGraph graph;
  try {
    graph.capture(torch::Device(torch::kCUDA, 0), [&] {
      auto x = x0.clone().requires_grad_(true);
      checkpoint_block(*fc, {x}, fn)[0].sum().backward();
    });
    ADD_FAILURE() << "a block preserving its RNG state was captured";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be captured"), std::string::npos) << e.what();
  }
}

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

// Llama on CUDA (GQA 8 heads over 2, tied, Llama-3 rope scaling) in bf16 on every attention backend,
// padded and packed, against the same weights in float64 on the CPU (math): the logits by relative
// error, the backward finite. `custom` is our flash kernel: a GPU build without it fails here.
TEST(GpuModels, LlamaInBf16MatchesTheFloat64CpuReferenceOnEveryBackendPaddedAndPacked) {
  REQUIRE_CUDA();
  torch::manual_seed(4);
  const std::string base =
      "{name: llama, vocab_size: 256, embed_dim: 512, depth: 2, num_heads: 8, num_kv_heads: 2, ffn_dim: 1024, "
      "max_seq_len: 256, rope_theta: 500000, tie_embeddings: true, "
      "rope_scaling: {rope_type: llama3, factor: 8, original_max_position_embeddings: 64}, attention: ";
  auto ref = testing::build_model(base + "math}");
  ref->to(torch::kCPU, torch::kFloat64);
  std::vector<Sample> samples = testing::token_samples({17, 255, 1, 128}, 256);
  auto padded_samples = samples, packed_samples = samples;
  const Batch padded = data::collate_tokens_padded(padded_samples, 0), packed = data::collate_tokens_packed(packed_samples);
  torch::Tensor want_padded, want_packed;
  {
    torch::NoGradGuard no_grad;
    want_padded = ref->forward(padded);
    want_packed = ref->forward(packed);
  }
  auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
    return ((a.cpu().to(torch::kFloat64) - b).norm() / b.norm()).item<double>();
  };
  for (const std::string backend : {"math", "sdpa", "custom"}) {
    auto m = testing::build_model(base + backend + "}");
    testing::copy_weights(*ref, *m);
    m->to(torch::kCUDA, torch::kBFloat16);
    for (const bool is_packed : {false, true}) {
      const Batch b = (is_packed ? packed : padded).to(torch::kCUDA);
      auto logits = m->forward(b);
      ASSERT_EQ(logits.scalar_type(), torch::kBFloat16) << backend;
      const auto& want = is_packed ? want_packed : want_padded;
      // padded rows beyond each sequence's length hold logits of pad tokens: compare the real ones
      torch::Tensor got = logits, ref_logits = want;
      if (!is_packed) {
        std::vector<torch::Tensor> g, r;
        for (size_t i = 0; i < samples.size(); ++i) {
          const int64_t n = samples[i].at("tokens").size(0);
          g.push_back(logits[i].narrow(0, 0, n));
          r.push_back(want[i].narrow(0, 0, n));
        }
        got = torch::cat(g);
        ref_logits = torch::cat(r);
      }
      const double e = rel(got, ref_logits);
      std::cout << "[ llama ] " << backend << (is_packed ? " packed" : " padded") << ": bf16 vs float64 relative error " << e << "\n";
      EXPECT_LT(e, 2e-2) << backend << (is_packed ? " packed" : " padded");
      logits.to(torch::kFloat32).pow(2).mean().backward();
      for (const auto& p : m->named_parameters())
        ASSERT_TRUE(p.value().grad().defined() && torch::isfinite(p.value().grad()).all().item<bool>()) << backend << " " << p.key();
      m->zero_grad();
    }
  }
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
