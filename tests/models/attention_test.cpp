#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/attention.h"

namespace strobe::models {
namespace {

TEST(Attention, SdpaMatchesMathWithCausalAndKeyPadding) {
  torch::manual_seed(0);
  auto q = torch::randn({2, 3, 6, 8}), k = torch::randn({2, 3, 6, 8}), v = torch::randn({2, 3, 6, 8});
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
  auto q = torch::randn({1, 1, 3, 4}), k = torch::randn({1, 1, 3, 4}), v = torch::randn({1, 1, 3, 4});
  auto expected = torch::matmul(torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / 2.0, -1), v);
  EXPECT_TRUE(torch::allclose(attention(q, k, v, false, std::nullopt, AttentionBackend::Math), expected, 1e-6, 1e-6));
}

TEST(Attention, VarlenEqualsAttentionOfEachSequenceAlone) {
  torch::manual_seed(1);
  const std::vector<int64_t> lengths = {3, 1, 6};
  const int64_t total = 10, h = 2, d = 4;
  auto q = torch::randn({total, h, d}, torch::requires_grad()), k = torch::randn({total, h, d}), v = torch::randn({total, h, d});
  auto cu = torch::tensor({0, 3, 4, 10}, torch::kInt32);
  for (auto backend : {AttentionBackend::Math, AttentionBackend::Sdpa}) {
    for (bool causal : {false, true}) {
      auto out = attention_varlen(q, k, v, cu, 6, causal, backend);
      ASSERT_EQ(out.sizes(), q.sizes());
      int64_t start = 0;
      for (int64_t n : lengths) {
        auto one = [&](const torch::Tensor& x) { return x.narrow(0, start, n).transpose(0, 1).unsqueeze(0); };
        auto ref = attention(one(q), one(k), one(v), causal, std::nullopt, AttentionBackend::Math)[0].transpose(0, 1);
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

TEST(Attention, BackendNamesParseAndCustomNamesTheMissingOp) {
  EXPECT_EQ(parse_attention_backend("math"), AttentionBackend::Math);
  EXPECT_EQ(parse_attention_backend("sdpa"), AttentionBackend::Sdpa);
  EXPECT_THROW(parse_attention_backend("flash"), std::invalid_argument);
  try {
    parse_attention_backend("custom");
    FAIL() << "custom should not parse before the op exists";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "attention: custom needs the strobe::flash_attention op, which is not built yet");
  }
}

}  // namespace
}  // namespace strobe::models
