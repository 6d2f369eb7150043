#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "models/attention.h"
#include "tests/models/model_test_util.h"

namespace strobe::models {
namespace {

TEST(Attention, SdpaMatchesMathWithCausalAndKeyPadding) {
  torch::manual_seed(0);
  auto q = torch::randn({2, 6, 3, 8}), k = torch::randn({2, 6, 3, 8}), v = torch::randn({2, 6, 3, 8});
  auto keep = torch::tensor({1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1}, torch::kBool).view({2, 6});
  for (bool causal : {false, true}) {
    for (bool masked : {false, true}) {
      std::optional<torch::Tensor> mask;
      if (masked) mask = keep;
      auto a = attention(q, k, v, causal, mask, AttentionBackend::Math);
      auto b = attention(q, k, v, causal, mask, AttentionBackend::Sdpa);
      EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-5)) << "causal=" << causal << " masked=" << masked;
    }
  }
}

TEST(Attention, MathIsSoftmaxOfScaledScores) {
  auto q = torch::randn({1, 3, 1, 4}), k = torch::randn({1, 3, 1, 4}), v = torch::randn({1, 3, 1, 4});
  auto t = [](const torch::Tensor& x) { return x.transpose(1, 2); };  // [B, H, S, D] for matmul
  auto expected = t(torch::matmul(torch::softmax(torch::matmul(t(q), t(k).transpose(-2, -1)) / 2.0, -1), t(v)));
  EXPECT_TRUE(torch::allclose(attention(q, k, v, false, std::nullopt, AttentionBackend::Math), expected, 1e-6, 1e-6));
}

TEST(Attention, VarlenEqualsAttentionOfEachSequenceAlone) {
  torch::manual_seed(1);
  const std::vector<int64_t> lengths = {3, 1, 6};
  const int64_t total = 10, h = 2, d = 4;
  auto q = torch::randn({total, h, d}, torch::requires_grad()), k = torch::randn({total, h, d}), v = torch::randn({total, h, d});
  auto cu = torch::tensor({0, 3, 4, 10}, torch::kInt32);
  for (auto backend : {AttentionBackend::Math, AttentionBackend::Sdpa, AttentionBackend::Custom}) {
    for (bool causal : {false, true}) {
      auto out = attention_varlen(q, k, v, cu, 6, causal, backend);
      ASSERT_EQ(out.sizes(), q.sizes());
      int64_t start = 0;
      for (int64_t n : lengths) {
        auto one = [&](const torch::Tensor& x) { return x.narrow(0, start, n).unsqueeze(0); };
        auto ref = attention(one(q), one(k), one(v), causal, std::nullopt, AttentionBackend::Math)[0];
        EXPECT_TRUE(torch::allclose(out.narrow(0, start, n), ref, 1e-5, 1e-5))
            << attention_backend_name(backend) << " causal=" << causal << " seq at " << start;
        start += n;
      }
      out.sum().backward();
      EXPECT_TRUE(torch::isfinite(q.grad()).all().item<bool>());
      q.mutable_grad().zero_();
    }
  }
}

TEST(Attention, BackendNamesParse) {
  EXPECT_EQ(parse_attention_backend("math"), AttentionBackend::Math);
  EXPECT_EQ(parse_attention_backend("sdpa"), AttentionBackend::Sdpa);
  EXPECT_EQ(parse_attention_backend("custom"), AttentionBackend::Custom);
  EXPECT_THROW(parse_attention_backend("flash"), std::invalid_argument);
}

// On CPU `custom` runs strobe::flash_attention's CPU kernel (the reference) through the op's
// autograd: same values and gradients as math, causal and not.
TEST(Attention, CustomOnCpuMatchesMathWithGradients) {
  torch::manual_seed(3);
  for (bool causal : {false, true}) {
    auto q = torch::randn({2, 5, 3, 8}, torch::requires_grad()), k = torch::randn({2, 7, 3, 8}, torch::requires_grad()),
         v = torch::randn({2, 7, 3, 8}, torch::requires_grad());
    auto a = attention(q, k, v, causal, std::nullopt, AttentionBackend::Custom);
    auto seed = torch::randn_like(a);
    auto ga = torch::autograd::grad({a}, {q, k, v}, {seed});
    auto b = attention(q, k, v, causal, std::nullopt, AttentionBackend::Math);
    auto gb = torch::autograd::grad({b}, {q, k, v}, {seed});
    EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-5)) << "causal=" << causal;
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::allclose(ga[i], gb[i], 1e-4, 1e-5)) << "grad " << i << " causal=" << causal;
  }
}

TEST(Attention, CustomRejectsAKeyPaddingMask) {
  auto q = torch::randn({1, 4, 2, 8});
  try {
    attention(q, q, q, true, torch::ones({1, 4}, torch::kBool), AttentionBackend::Custom);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("custom takes no key padding mask"), std::string::npos) << e.what();
  }
}

// What `custom` cannot run on CUDA is a config error before training, from each transformer's
// on_device (the Trainer calls it before the first step), not a kernel error inside the step. No
// CUDA device is needed: the check reads the device's kind only.
TEST(Attention, CustomOnCudaRefusesWhatItsKernelsCannotRunBeforeTraining) {
  const torch::Device cuda(torch::kCUDA, 0);
  auto error_of = [&](const std::string& yaml, const std::string& precision) -> std::string {
    auto m = testing::build_model(yaml);
    try {
      m->on_device(cuda, parse_precision(precision));
    } catch (const config::ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  const std::string llama32 =
      "{name: llama, vocab_size: 64, embed_dim: 64, depth: 1, num_heads: 2, num_kv_heads: 1, ffn_dim: 64, "
      "max_seq_len: 16, attention: custom}";  // head_dim 32
  const std::string vit48 =
      "{name: vit, img_size: 16, patch_size: 8, num_classes: 2, embed_dim: 96, depth: 1, num_heads: 2, attention: custom}";
  const std::string lm64 =
      "{name: decoder_lm, vocab_size: 64, max_seq_len: 16, embed_dim: 128, depth: 1, num_heads: 2, attention: custom}";
  if (!ops::built_with_cuda()) {
    for (const auto& y : {llama32, vit48, lm64})
      EXPECT_NE(error_of(y, "bf16-mixed").find("model.attention: custom on CUDA needs strobe_ops built with its CUDA kernels"),
                std::string::npos);
    GTEST_SKIP() << "strobe_ops built without CUDA kernels: the head_dim and precision checks need them";
  }
  EXPECT_EQ(error_of(llama32, "bf16-master"),
            "model.attention: custom on CUDA takes head_dim 64 or 128 (embed_dim / num_heads), this model's is 32; "
            "use attention: sdpa or change num_heads");
  EXPECT_NE(error_of(vit48, "bf16-mixed").find("this model's is 48"), std::string::npos);
  EXPECT_NE(error_of(lm64, "32").find("trainer.precision 32 gives fp32 ones"), std::string::npos);
  EXPECT_EQ(error_of(lm64, "bf16-master"), "no error");
  EXPECT_EQ(error_of(lm64, "16-mixed"), "no error");
  // Other backends, and custom on the CPU (the reference), take any head_dim and precision.
  EXPECT_EQ(error_of("{name: decoder_lm, vocab_size: 64, max_seq_len: 16, embed_dim: 96, depth: 1, num_heads: 2, attention: sdpa}", "32"),
            "no error");
  auto m = testing::build_model(vit48);
  EXPECT_NO_THROW(m->on_device(torch::kCPU, Precision::k32));
}

}  // namespace
}  // namespace strobe::models
