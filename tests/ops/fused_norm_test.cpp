// strobe::add_layer_norm / layer_norm / cross_entropy on CPU (their ATen reference kernels) against
// independent float64 references (at::layer_norm, at::cross_entropy and autograd in double):
// forward outputs and every gradient by relative error, odd shapes, NaN propagation, bad input.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/ops/op_test_util.h"

namespace {

using torch::Tensor;

using strobe::testing::check_norm_amax;
using strobe::testing::rel_err;

struct LnCase {
  std::vector<int64_t> shape;
  bool delta, bias;
  torch::ScalarType dtype;
};

void PrintTo(const LnCase& c, std::ostream* os) {
  for (auto s : c.shape) *os << s << "x";
  *os << (c.delta ? "delta_" : "nodelta_") << (c.bias ? "bias_" : "nobias_") << c10::toString(c.dtype);
}

class AddLayerNormCpu : public ::testing::TestWithParam<LnCase> {};

// Bounds: fp32 1e-5 on every tensor; bf16 inputs: outputs in bf16 (one rounding: 8e-3), gradients
// of x in bf16 (8e-3), weight/bias gradients in bf16 (8e-3).
TEST_P(AddLayerNormCpu, MatchesFloat64AtenLayerNormForwardAndBackward) {
  const LnCase c = GetParam();
  torch::manual_seed(3);
  const int64_t ch = c.shape.back();
  const bool lowp = c.dtype != torch::kFloat;
  const double bound = lowp ? 8e-3 : 1e-5;
  const auto opt = torch::TensorOptions().dtype(c.dtype);
  const Tensor x = (torch::randn(c.shape) * 2 + 0.5).to(c.dtype).requires_grad_();
  const Tensor d = torch::randn(c.shape).to(c.dtype).requires_grad_();
  const Tensor w = (torch::randn({ch}) * 0.5 + 1).to(c.dtype).requires_grad_();
  const Tensor b = (torch::randn({ch}) * 0.1).to(c.dtype).requires_grad_();
  const std::optional<Tensor> bias = c.bias ? std::optional<Tensor>(b) : std::nullopt;

  Tensor sum, y;
  if (c.delta) {
    std::tie(sum, y) = strobe::ops::add_layer_norm(x, d, w, bias, 1e-6);
  } else {
    y = strobe::ops::layer_norm(x, w, bias, 1e-6);
  }
  ASSERT_EQ(y.scalar_type(), c.dtype);
  ASSERT_EQ(y.sizes(), x.sizes());

  // float64 reference from the same (rounded) inputs.
  const Tensor x64 = x.detach().to(torch::kDouble).requires_grad_();
  const Tensor d64 = d.detach().to(torch::kDouble).requires_grad_();
  const Tensor w64 = w.detach().to(torch::kDouble).requires_grad_();
  const Tensor b64 = b.detach().to(torch::kDouble).requires_grad_();
  // The op rounds the sum to the input dtype before normalising; the reference does the same.
  Tensor s64 = c.delta ? (x64 + d64) : x64;
  if (lowp && c.delta) s64 = s64 + ((x64 + d64).detach().to(c.dtype).to(torch::kDouble) - (x64 + d64).detach());
  const Tensor y64 = torch::layer_norm(s64, {ch}, w64, c.bias ? b64 : Tensor(), 1e-6);
  EXPECT_LT(rel_err(y, y64), bound) << "y";
  if (c.delta) {
    ASSERT_EQ(sum.scalar_type(), c.dtype);
    EXPECT_LT(rel_err(sum, s64), lowp ? 4e-3 : 1e-7) << "sum";
  }

  const Tensor gy = torch::randn(c.shape).to(c.dtype);
  const Tensor gs = torch::randn(c.shape).to(c.dtype);
  Tensor loss = (y.to(torch::kDouble) * gy.to(torch::kDouble)).sum();
  Tensor loss64 = (y64 * gy.to(torch::kDouble)).sum();
  if (c.delta) {
    loss = loss + (sum.to(torch::kDouble) * gs.to(torch::kDouble)).sum();
    loss64 = loss64 + (s64 * gs.to(torch::kDouble)).sum();
  }
  loss.backward();
  loss64.backward();
  EXPECT_LT(rel_err(x.grad(), x64.grad()), bound) << "dx";
  if (c.delta) EXPECT_LT(rel_err(d.grad(), d64.grad()), bound) << "ddelta";
  EXPECT_LT(rel_err(w.grad(), w64.grad()), bound) << "dweight";
  if (c.bias) {
    EXPECT_LT(rel_err(b.grad(), b64.grad()), bound) << "dbias";
  } else {
    EXPECT_FALSE(b.grad().defined());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AddLayerNormCpu,
    ::testing::Values(LnCase{{4, 9, 64}, true, true, torch::kFloat}, LnCase{{4, 9, 64}, true, false, torch::kFloat},
                      LnCase{{4, 9, 64}, false, true, torch::kFloat}, LnCase{{1, 7}, true, true, torch::kFloat},
                      LnCase{{1, 1}, true, true, torch::kFloat}, LnCase{{37, 1000}, true, false, torch::kFloat},
                      LnCase{{3, 5, 96}, true, true, torch::kBFloat16}, LnCase{{6, 33}, true, false, torch::kBFloat16},
                      LnCase{{5, 40}, false, false, torch::kHalf}));

TEST(AddLayerNormCpu, NanPropagatesToItsRowOnly) {
  Tensor x = torch::randn({3, 16});
  x[1][4] = NAN;
  auto [s, y] = strobe::ops::add_layer_norm(x, torch::zeros_like(x), torch::ones({16}), torch::zeros({16}));
  EXPECT_TRUE(torch::isnan(y[1]).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(y[0]).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(y[2]).all().item<bool>());
  // A NaN in the weight reaches that column's output.
  Tensor w = torch::ones({16});
  w[2] = NAN;
  const Tensor y2 = strobe::ops::layer_norm(torch::randn({2, 16}), w);
  EXPECT_TRUE(torch::isnan(y2.select(1, 2)).all().item<bool>());
}

TEST(AddLayerNormCpu, BadInputsAreErrors) {
  const Tensor x = torch::randn({2, 8});
  EXPECT_THROW(strobe::ops::layer_norm(x, torch::ones({7})), c10::Error);
  EXPECT_THROW(strobe::ops::add_layer_norm(x, torch::randn({2, 7}), torch::ones({8})), c10::Error);
  EXPECT_THROW(strobe::ops::add_layer_norm(x, torch::randn({2, 8}, torch::kDouble), torch::ones({8})), c10::Error);
  EXPECT_THROW(strobe::ops::layer_norm(x, torch::ones({8}), torch::ones({7})), c10::Error);
  EXPECT_THROW(strobe::ops::layer_norm(torch::ones({2, 8}, torch::kLong), torch::ones({8})), c10::Error);
}

// ---- add_rms_norm / rms_norm ------------------------------------------------------------------

// y = w * x / sqrt(mean(x^2) + eps) in float64 autograd: the independent reference.
Tensor rms_norm_64(const Tensor& x64, const Tensor& w64, double eps) {
  return w64 * (x64 * torch::rsqrt(x64.pow(2).mean(-1, true) + eps));
}

// Hugging Face's LlamaRMSNorm.forward, written out: fp32 statistics, the normalised row cast to the
// input dtype, then multiplied by the weight in the promoted dtype.
Tensor hf_rms_norm(const Tensor& x, const Tensor& w, double eps) {
  const Tensor xf = x.to(torch::kFloat);
  return w * (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
}

class AddRmsNormCpu : public ::testing::TestWithParam<LnCase> {};

// Bounds: fp32 1e-5 on every tensor. bf16/fp16: y is rounded twice (the normalised row, then the
// product with the weight), 1e-2; dx (rounded once) 8e-3; dweight (summed from the rounded row) 8e-3.
// On the CPU the forward is Hugging Face's own sequence of ATen ops: equal to it bit for bit.
TEST_P(AddRmsNormCpu, MatchesFloat64ReferenceAndHuggingFaceExactly) {
  const LnCase c = GetParam();
  torch::manual_seed(11);
  const int64_t ch = c.shape.back();
  const bool lowp = c.dtype != torch::kFloat;
  const Tensor x = (torch::randn(c.shape) * 2 + 0.5).to(c.dtype).requires_grad_();
  const Tensor d = torch::randn(c.shape).to(c.dtype).requires_grad_();
  const Tensor w = (torch::randn({ch}) * 0.5 + 1).to(c.dtype).requires_grad_();
  Tensor sum, y;
  if (c.delta) {
    std::tie(sum, y) = strobe::ops::add_rms_norm(x, d, w, 1e-6);
    EXPECT_TRUE(torch::equal(sum, (x + d).detach())) << "sum";
  } else {
    y = strobe::ops::rms_norm(x, w, 1e-6);
  }
  ASSERT_EQ(y.scalar_type(), c.dtype);
  const Tensor in = (c.delta ? sum : x).detach();
  EXPECT_TRUE(torch::equal(y.detach(), hf_rms_norm(in, w.detach(), 1e-6))) << "not Hugging Face's numerics";

  const Tensor s64 = in.to(torch::kDouble).requires_grad_();
  const Tensor w64 = w.detach().to(torch::kDouble).requires_grad_();
  const Tensor y64 = rms_norm_64(s64, w64, 1e-6);
  EXPECT_LT(rel_err(y, y64), lowp ? 1e-2 : 1e-5) << "y";
  const Tensor gy = torch::randn(c.shape).to(c.dtype);
  const Tensor gs = torch::randn(c.shape).to(c.dtype);
  Tensor loss = (y.to(torch::kDouble) * gy.to(torch::kDouble)).sum();
  if (c.delta) loss = loss + (sum.to(torch::kDouble) * gs.to(torch::kDouble)).sum();
  loss.backward();
  (y64 * gy.to(torch::kDouble)).sum().backward();
  Tensor dx64 = s64.grad();
  if (c.delta) dx64 = dx64 + gs.to(torch::kDouble);
  EXPECT_LT(rel_err(x.grad(), dx64), lowp ? 8e-3 : 1e-5) << "dx";
  if (c.delta) EXPECT_TRUE(torch::equal(x.grad(), d.grad())) << "ddelta == dx";
  ASSERT_EQ(w.grad().scalar_type(), c.dtype);
  EXPECT_LT(rel_err(w.grad(), w64.grad()), lowp ? 8e-3 : 1e-5) << "dweight";
}

INSTANTIATE_TEST_SUITE_P(Shapes, AddRmsNormCpu,
                         ::testing::Values(LnCase{{4, 9, 64}, true, false, torch::kFloat},
                                           LnCase{{4, 9, 64}, false, false, torch::kFloat},
                                           LnCase{{1, 1}, true, false, torch::kFloat},
                                           LnCase{{37, 1000}, true, false, torch::kFloat},
                                           LnCase{{3, 5, 96}, true, false, torch::kBFloat16},
                                           LnCase{{6, 33}, false, false, torch::kBFloat16},
                                           LnCase{{5, 40}, true, false, torch::kHalf}));

TEST(AddRmsNormCpu, NanPropagatesToItsRowAndBadInputsAreErrors) {
  Tensor x = torch::randn({3, 16});
  x[1][4] = NAN;
  auto [s, y] = strobe::ops::add_rms_norm(x, torch::zeros_like(x), torch::ones({16}));
  EXPECT_TRUE(torch::isnan(y[1]).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(y[0]).all().item<bool>());
  Tensor w = torch::ones({16});
  w[2] = NAN;
  EXPECT_TRUE(torch::isnan(strobe::ops::rms_norm(torch::randn({2, 16}), w).select(1, 2)).all().item<bool>());
  const Tensor xb = torch::randn({2, 8}).to(torch::kBFloat16);
  EXPECT_THROW(strobe::ops::rms_norm(xb, torch::ones({7}, torch::kBFloat16)), c10::Error);
  EXPECT_THROW(strobe::ops::add_rms_norm(xb, torch::randn({2, 8}), torch::ones({8}, torch::kBFloat16)), c10::Error);
  EXPECT_THROW(strobe::ops::rms_norm(torch::ones({2, 8}, torch::kLong), torch::ones({8})), c10::Error);
  // An fp32 weight would promote bf16 activations (y keeps x's dtype): refused, naming both.
  try {
    strobe::ops::rms_norm(xb, torch::ones({8}));
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("a Float weight would promote the BFloat16 activations"), std::string::npos)
        << e.what();
  }
}

// add_layer_norm_amax / add_rms_norm_amax against the plain ops (check_norm_amax, op_test_util.h).
TEST(AddNormAmaxCpu, TheAmaxVariantsGiveTheSameValuesAndGradientsAndMaxOfY) {
  check_norm_amax(torch::kCPU, torch::kBFloat16, 9, 48, "bf16");
  check_norm_amax(torch::kCPU, torch::kFloat, 5, 20, "fp32");
}

// ---- rotary_qk ------------------------------------------------------------------------------

// transformers' apply_rotary_pos_emb on one tensor [..., H, D] with cos / sin [..., D].
Tensor hf_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const auto c = cos.unsqueeze(-2).to(x.scalar_type()), s = sin.unsqueeze(-2).to(x.scalar_type());
  const int64_t h = x.size(-1) / 2;
  return x * c + torch::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1) * s;
}

// Forward and backward equal to transformers' ops and autograd bit for bit (fp32, bf16, fp16; padded
// [B, S, H, D] and packed [T, H, D]; 4 query heads over 2 K/V heads), and within 1e-6 (fp32) of a
// float64 rotation.
TEST(RotaryCpu, IsHuggingFacesRotaryBitForBitForwardAndBackward) {
  for (auto dt : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (auto lead : {std::vector<int64_t>{2, 7}, std::vector<int64_t>{13}}) {
      SCOPED_TRACE(std::string(c10::toString(dt)) + " lead rank " + std::to_string(lead.size()));
      torch::manual_seed(21);
      auto shape = [&](int64_t heads, int64_t d) {
        auto s = lead;
        s.push_back(heads);
        if (d) s.push_back(d);
        return s;
      };
      const int64_t d = 16;
      const Tensor q = torch::randn(shape(4, d)).to(dt).requires_grad_(), k = torch::randn(shape(2, d)).to(dt).requires_grad_();
      auto cs = lead;
      cs.push_back(d);
      const Tensor ang = torch::rand(cs) * 40;
      const Tensor cos = ang.cos(), sin = ang.sin();
      auto [qo, ko] = strobe::ops::rotary_qk(q, k, cos, sin);
      const Tensor q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_();
      const Tensor qr = hf_rotary(q2, cos, sin), kr = hf_rotary(k2, cos, sin);
      EXPECT_TRUE(torch::equal(qo, qr)) << "q";
      EXPECT_TRUE(torch::equal(ko, kr)) << "k";
      const Tensor gq = torch::randn(qo.sizes()).to(dt), gk = torch::randn(ko.sizes()).to(dt);
      torch::autograd::backward({qo, ko}, {gq, gk});
      torch::autograd::backward({qr, kr}, {gq, gk});
      EXPECT_TRUE(torch::equal(q.grad(), q2.grad())) << "dq";
      EXPECT_TRUE(torch::equal(k.grad(), k2.grad())) << "dk";
      if (dt == torch::kFloat) {
        const Tensor q64 = q.detach().to(torch::kDouble);
        const Tensor c64 = cos.to(torch::kDouble).unsqueeze(-2), s64 = sin.to(torch::kDouble).unsqueeze(-2);
        const Tensor want = q64 * c64 + torch::cat({-q64.narrow(-1, 8, 8), q64.narrow(-1, 0, 8)}, -1) * s64;
        EXPECT_LT(rel_err(qo, want), 1e-6);
      }
    }
  }
  // Only one output used: the other's gradient is zero, not an error.
  const Tensor q = torch::randn({3, 4, 8}).requires_grad_(), k = torch::randn({3, 2, 8}).requires_grad_();
  const Tensor ang = torch::rand({3, 8});
  std::get<0>(strobe::ops::rotary_qk(q, k, ang.cos(), ang.sin())).sum().backward();
  EXPECT_TRUE(q.grad().defined());
  EXPECT_FALSE(k.grad().defined() && k.grad().abs().sum().item<double>() != 0.0);
}

TEST(RotaryCpu, NanPropagatesAndBadShapesAreErrors) {
  Tensor q = torch::randn({5, 4, 8});
  q[2][1][3] = NAN;
  const Tensor ang = torch::rand({5, 8});
  const auto [qo, ko] = strobe::ops::rotary_qk(q, torch::randn({5, 2, 8}), ang.cos(), ang.sin());
  EXPECT_TRUE(torch::isnan(qo[2][1][3]).item<bool>());
  EXPECT_TRUE(torch::isnan(qo[2][1][7]).item<bool>()) << "its pair";
  EXPECT_TRUE(torch::isfinite(qo[2][0]).all().item<bool>());
  const Tensor k = torch::randn({5, 2, 8});
  EXPECT_THROW(strobe::ops::rotary_qk(torch::randn({5, 4, 7}), torch::randn({5, 2, 7}), torch::rand({5, 7}), torch::rand({5, 7})),
               c10::Error);  // odd head_dim
  EXPECT_THROW(strobe::ops::rotary_qk(q, torch::randn({4, 2, 8}), ang.cos(), ang.sin()), c10::Error);
  EXPECT_THROW(strobe::ops::rotary_qk(q, k, torch::rand({1, 8}), torch::rand({1, 8})), c10::Error);  // not one row per token
  EXPECT_THROW(strobe::ops::rotary_qk(q, k.to(torch::kDouble), ang.cos(), ang.sin()), c10::Error);
}

// ---- swiglu ---------------------------------------------------------------------------------

// silu(gate) * up over gate_up [..., 2F] equals transformers' `act_fn(gate_proj(x)) * up_proj(x)` op for op
// on the CPU, forward and autograd backward (fp32, bf16), and a float64 reference within 1e-6 (fp32).
TEST(SwigluCpu, IsHuggingFacesSiluTimesUpBitForBitForwardAndBackward) {
  for (auto dt : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dt));
    torch::manual_seed(31);
    const Tensor gu = (torch::randn({3, 5, 2 * 24}) * 3).to(dt).requires_grad_();
    const Tensor y = strobe::ops::swiglu(gu);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, 24}));
    const Tensor gate = gu.detach().narrow(-1, 0, 24).clone().requires_grad_(), up = gu.detach().narrow(-1, 24, 24).clone().requires_grad_();
    const Tensor ref = torch::silu(gate) * up;
    EXPECT_TRUE(torch::equal(y, ref));
    const Tensor g = torch::randn(y.sizes()).to(dt);
    y.backward(g);
    ref.backward(g);
    EXPECT_TRUE(torch::equal(gu.grad().narrow(-1, 0, 24), gate.grad())) << "d gate";
    EXPECT_TRUE(torch::equal(gu.grad().narrow(-1, 24, 24), up.grad())) << "d up";
    if (dt == torch::kFloat) {
      const Tensor g64 = gu.detach().to(torch::kDouble).requires_grad_();
      const Tensor y64 = torch::silu(g64.narrow(-1, 0, 24)) * g64.narrow(-1, 24, 24);
      EXPECT_LT(rel_err(y, y64), 1e-6);
      y64.backward(g.to(torch::kDouble));
      EXPECT_LT(rel_err(gu.grad(), g64.grad()), 1e-6);
    }
  }
  Tensor gu = torch::randn({4, 8});
  gu[1][1] = NAN;  // gate column 1 of row 1
  const Tensor y = strobe::ops::swiglu(gu);
  EXPECT_TRUE(torch::isnan(y[1][1]).item<bool>());
  EXPECT_EQ(torch::isnan(y).sum().item<int64_t>(), 1);
  EXPECT_THROW(strobe::ops::swiglu(torch::randn({4, 7})), c10::Error);
  EXPECT_THROW(strobe::ops::swiglu(torch::ones({4, 8}, torch::kLong)), c10::Error);
}

// ---- linear_cross_entropy --------------------------------------------------------------------

// Against the unfused head (linear, then cross-entropy on an fp32 copy of the logits, as the task
// computes it) and float64 autograd: every chunking gives the same loss and gradients (fp32 1e-6 /
// 1e-5; bf16 weights and activations 8e-3), with and without bias, ignored targets included.
TEST(LinearCrossEntropyCpu, MatchesTheUnfusedHeadForEveryChunking) {
  for (auto dt : {torch::kFloat, torch::kBFloat16}) {
    for (bool bias : {false, true}) {
      SCOPED_TRACE(std::string(c10::toString(dt)) + (bias ? " bias" : ""));
      torch::manual_seed(41);
      const int64_t n = 37, c = 16, v = 101;
      const Tensor h = torch::randn({n, c}).to(dt).requires_grad_();
      const Tensor w = (torch::randn({v, c}) * 0.3).to(dt).requires_grad_();
      const Tensor b = (torch::randn({v}) * 0.1).to(dt).requires_grad_();
      Tensor t = torch::randint(0, v, {n}, torch::kLong);
      t.index_put_({torch::indexing::Slice(0, n, 4)}, -100);
      const std::optional<Tensor> ob = bias ? std::optional<Tensor>(b) : std::nullopt;
      // The unfused head, as language_modeling computes it.
      const Tensor h2 = h.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
      const Tensor b2 = b.detach().clone().requires_grad_();
      const Tensor ref = torch::nn::functional::cross_entropy(
          torch::linear(h2, w2, bias ? b2 : Tensor()).to(torch::kFloat), t,
          torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
      ref.backward();
      const Tensor h64 = h.detach().to(torch::kDouble).requires_grad_(), w64 = w.detach().to(torch::kDouble).requires_grad_();
      const Tensor b64 = b.detach().to(torch::kDouble).requires_grad_();
      const Tensor ref64 = torch::nn::functional::cross_entropy(
          torch::linear(h64, w64, bias ? b64 : Tensor()), t, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
      ref64.backward();
      const double bound = dt == torch::kFloat ? 1e-5 : 8e-3;
      for (int64_t chunk : {0, 1, 5, 37, 100}) {
        SCOPED_TRACE("chunk_rows " + std::to_string(chunk));
        h.mutable_grad() = Tensor();
        w.mutable_grad() = Tensor();
        b.mutable_grad() = Tensor();
        const Tensor loss = strobe::ops::linear_cross_entropy(h, w, ob, t, -100, chunk);
        ASSERT_EQ(loss.scalar_type(), torch::kFloat);
        EXPECT_LT(rel_err(loss, ref), dt == torch::kFloat ? 1e-6 : 1e-3) << "loss vs unfused";
        EXPECT_LT(rel_err(loss, ref64), dt == torch::kFloat ? 1e-6 : 8e-3) << "loss vs float64";
        (loss * 3).backward();  // the incoming gradient scales every gradient
        ASSERT_EQ(h.grad().scalar_type(), dt);
        ASSERT_EQ(w.grad().scalar_type(), dt);
        EXPECT_LT(rel_err(h.grad(), 3 * h64.grad()), bound) << "dhidden";
        EXPECT_LT(rel_err(w.grad(), 3 * w64.grad()), bound) << "dweight";
        EXPECT_LT(rel_err(h.grad(), 3 * h2.grad().to(torch::kDouble)), bound) << "dhidden vs unfused";
        if (bias) EXPECT_LT(rel_err(b.grad(), 3 * b64.grad()), bound) << "dbias";
        else EXPECT_FALSE(b.grad().defined());
        // Ignored rows get exactly zero gradient.
        EXPECT_EQ(h.grad()[0].abs().max().item<float>(), 0.f);
      }
    }
  }
}

TEST(LinearCrossEntropyCpu, NanAndNoValidTokensGiveNanAndBadInputsAreErrors) {
  const Tensor w = torch::randn({11, 8});
  Tensor h = torch::randn({6, 8});
  h[2][3] = NAN;
  const Tensor t = torch::randint(0, 11, {6}, torch::kLong);
  EXPECT_TRUE(torch::isnan(strobe::ops::linear_cross_entropy(h, w, std::nullopt, t)).item<bool>());
  EXPECT_TRUE(torch::isnan(strobe::ops::linear_cross_entropy(torch::randn({6, 8}), w, std::nullopt,
                                                             torch::full({6}, -100, torch::kLong)))
                  .item<bool>());
  EXPECT_THROW(strobe::ops::linear_cross_entropy(torch::randn({6, 7}), w, std::nullopt, t), c10::Error);
  EXPECT_THROW(strobe::ops::linear_cross_entropy(torch::randn({6, 8}), w, std::nullopt, t.narrow(0, 0, 5)), c10::Error);
  EXPECT_THROW(strobe::ops::linear_cross_entropy(torch::randn({6, 8}).to(torch::kBFloat16), w, std::nullopt, t), c10::Error);
  EXPECT_THROW(strobe::ops::linear_cross_entropy(torch::randn({6, 8}), w, torch::zeros({10}), t), c10::Error);
}

// The forward makes the gradients and the backward hands them out once, rounded from the fp32
// accumulator (bf16 weight: d weight is the fp32 one times the incoming gradient, rounded once);
// only the inputs that want a gradient get one; a second backward through the same forward is one
// clear error, not the first backward's gradients again.
TEST(LinearCrossEntropyCpu, BackwardRoundsOnceGivesOnlyWantedGradientsAndRefusesASecondPass) {
  torch::manual_seed(4);
  const Tensor h = torch::randn({9, 8}).to(torch::kBFloat16).requires_grad_();
  const Tensor w = (torch::randn({13, 8}) * 0.5).to(torch::kBFloat16).requires_grad_();
  const Tensor t = torch::randint(0, 13, {9}, torch::kLong);
  const Tensor loss = strobe::ops::linear_cross_entropy(h, w, std::nullopt, t) * 3.0;
  loss.backward({}, /*retain_graph=*/true);
  ASSERT_EQ(w.grad().scalar_type(), torch::kBFloat16);
  auto [l32, dh32, dw32, db32] = [&] {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("strobe::linear_cross_entropy_fwd", "")
                               .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(
                                   const Tensor&, const Tensor&, const std::optional<Tensor>&, const Tensor&, int64_t,
                                   int64_t, bool)>();
    torch::NoGradGuard ng;
    return op.call(h.detach(), w.detach(), std::nullopt, t, -100, 0, true);
  }();
  ASSERT_EQ(dw32.scalar_type(), torch::kFloat) << "d weight waits in its fp32 accumulator";
  EXPECT_TRUE(torch::equal(w.grad(), (dw32 * 3.0).to(torch::kBFloat16))) << "one rounding of the scaled fp32 value";
  EXPECT_TRUE(torch::equal(h.grad(), (dh32 * 3.0).to(torch::kBFloat16)));
  try {
    loss.backward();
    ADD_FAILURE() << "a second backward through the same forward went through";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("second backward through the same forward"), std::string::npos)
        << e.what_without_backtrace();
  }
  // A frozen head: only hidden gets a gradient.
  const Tensor h2 = h.detach().clone().requires_grad_();
  const Tensor w2 = w.detach().clone();
  strobe::ops::linear_cross_entropy(h2, w2, std::nullopt, t).backward();
  EXPECT_TRUE(h2.grad().defined());
  EXPECT_FALSE(w2.grad().defined());
}

struct CeCase {
  int64_t n, v;
  const char* reduction;
  torch::ScalarType dtype;
};
void PrintTo(const CeCase& c, std::ostream* os) {
  *os << c.n << "x" << c.v << "_" << c.reduction << "_" << c10::toString(c.dtype);
}

class CrossEntropyCpu : public ::testing::TestWithParam<CeCase> {};

// Bounds: the loss is fp32 from the given logits (1e-6 against double); the gradient has the
// logits' dtype (fp32 1e-6, bf16 8e-3).
TEST_P(CrossEntropyCpu, MatchesFloat64AtenCrossEntropy) {
  const CeCase c = GetParam();
  torch::manual_seed(5);
  const Tensor logits = (torch::randn({c.n, c.v}) * 3).to(c.dtype).requires_grad_();
  Tensor target = torch::randint(0, c.v, {c.n}, torch::kLong);
  if (c.n > 2) target.index_put_({torch::indexing::Slice(0, c.n, 3)}, -100);  // some ignored rows
  const Tensor loss = strobe::ops::cross_entropy(logits, target, -100, c.reduction);
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);
  const Tensor l64 = logits.detach().to(torch::kDouble).requires_grad_();
  auto opts = torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100);
  const std::string r = c.reduction;
  if (r == "mean") opts.reduction(torch::kMean);
  if (r == "sum") opts.reduction(torch::kSum);
  if (r == "none") opts.reduction(torch::kNone);
  const Tensor ref = torch::nn::functional::cross_entropy(l64, target, opts);
  EXPECT_LT(rel_err(loss, ref), 1e-6) << "loss";
  const Tensor g = torch::randn(ref.sizes());
  (loss.to(torch::kDouble) * g.to(torch::kDouble)).sum().backward();
  (ref * g.to(torch::kDouble)).sum().backward();
  ASSERT_EQ(logits.grad().scalar_type(), c.dtype);
  EXPECT_LT(rel_err(logits.grad(), l64.grad()), c.dtype == torch::kFloat ? 1e-6 : 8e-3) << "dlogits";
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyCpu,
                         ::testing::Values(CeCase{64, 1000, "mean", torch::kFloat}, CeCase{64, 1000, "sum", torch::kFloat},
                                           CeCase{64, 1000, "none", torch::kFloat}, CeCase{1, 3, "mean", torch::kFloat},
                                           CeCase{33, 517, "mean", torch::kBFloat16}));

TEST(CrossEntropyCpu, NanLogitGivesNanLossAndBadTargetsAreErrors) {
  Tensor logits = torch::randn({4, 10});
  logits[2][7] = NAN;
  const Tensor t = torch::tensor({1, 2, 3, 4}, torch::kLong);
  EXPECT_TRUE(torch::isnan(strobe::ops::cross_entropy(logits, t)).item<bool>());
  EXPECT_TRUE(torch::isnan(strobe::ops::cross_entropy(logits, t, -100, "none")[2]).item<bool>());
  EXPECT_THROW(strobe::ops::cross_entropy(torch::randn({4, 10}), torch::tensor({1, 2, 10, 4}, torch::kLong)), c10::Error);
  EXPECT_THROW(strobe::ops::cross_entropy(torch::randn({4, 10}), torch::tensor({1, 2, 3}, torch::kLong)), c10::Error);
  EXPECT_THROW(strobe::ops::cross_entropy(torch::randn({4, 10}), t, -100, "avg"), c10::Error);
  // Every row ignored: mean is NaN (0 / 0), as PyTorch.
  EXPECT_TRUE(torch::isnan(strobe::ops::cross_entropy(torch::randn({2, 5}), torch::full({2}, -100, torch::kLong)))
                  .item<bool>());
}

// fused_mlp's CPU reference against float64 autograd through linear / gelu(tanh) / linear.
// Bounds: fp32 1e-5 everywhere; bf16 8e-3 (the pre-activation and activation are stored in bf16).
TEST(FusedMlpCpu, MatchesFloat64LinearGeluTanhLinear) {
  for (auto dt : {torch::kFloat, torch::kBFloat16}) {
    for (auto shape : {std::vector<int64_t>{3, 5, 16}, std::vector<int64_t>{1, 7}}) {
      torch::manual_seed(7);
      const int64_t c = shape.back(), h = 4 * c + 3, n = c + 1;
      auto mk = [&](std::vector<int64_t> s, double sc) { return (torch::randn(s) * sc).to(dt).requires_grad_(); };
      const Tensor x = mk(shape, 1.0), w1 = mk({h, c}, 0.3), b1 = mk({h}, 0.1), w2 = mk({n, h}, 0.1), b2 = mk({n}, 0.1);
      const Tensor y = strobe::ops::fused_mlp(x, w1, b1, w2, b2);
      ASSERT_EQ(y.scalar_type(), dt);
      std::vector<Tensor> d64;
      for (const Tensor& t : {x, w1, b1, w2, b2}) d64.push_back(t.detach().to(torch::kDouble).requires_grad_());
      const Tensor y64 =
          torch::linear(torch::gelu(torch::linear(d64[0], d64[1], d64[2]), "tanh"), d64[3], d64[4]);
      const double bound = dt == torch::kFloat ? 1e-5 : 8e-3;
      EXPECT_LT(rel_err(y, y64), bound) << "y " << c10::toString(dt);
      const Tensor g = torch::randn(y64.sizes());
      (y.to(torch::kDouble) * g.to(torch::kDouble)).sum().backward();
      (y64 * g.to(torch::kDouble)).sum().backward();
      const char* names[] = {"dx", "dw1", "db1", "dw2", "db2"};
      const Tensor got[] = {x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()};
      for (int i = 0; i < 5; ++i) EXPECT_LT(rel_err(got[i], d64[i].grad()), 2 * bound) << names[i] << " " << c10::toString(dt);
    }
  }
  Tensor x = torch::randn({2, 8});
  x[1][3] = NAN;
  const Tensor y = strobe::ops::fused_mlp(x, torch::randn({16, 8}), torch::zeros({16}), torch::randn({8, 16}), torch::zeros({8}));
  EXPECT_TRUE(torch::isnan(y[1]).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(y[0]).all().item<bool>());
  EXPECT_THROW(strobe::ops::fused_mlp(x, torch::randn({16, 8}), torch::zeros({16}), torch::randn({8, 15}), torch::zeros({8})),
               c10::Error);
  EXPECT_THROW(strobe::ops::fused_mlp(x, torch::randn({16, 8}, torch::kDouble), torch::zeros({16}), torch::randn({8, 16}),
                                      torch::zeros({8})),
               c10::Error);
}

}  // namespace
