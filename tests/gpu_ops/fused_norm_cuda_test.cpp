// add_layer_norm's, add_rms_norm's and cross_entropy's CUDA kernels against float64 references (at::layer_norm /
// cross_entropy and autograd in double on the CPU), fresh random inputs, the caching allocator
// poisoned with NaN first so an unwritten output element fails; NaN inputs must come out NaN.
// Bounds (relative error of the whole tensor): fp32 1e-5, bf16 / fp16 outputs and gradients 8e-3
// (one rounding to the 16-bit type is <= 2^-8 per element), parameter gradients 1e-5 in fp32 and
// 8e-3 when the parameters are bf16 (they are returned in the parameters' dtype).
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/gpu_test_util.h"

namespace {

using torch::Tensor;

using strobe::testing::kCuda;
using strobe::testing::poison_allocator;
using strobe::testing::check_norm_amax;
using strobe::testing::rel_err;

struct LnCase {
  int64_t rows, cols;
  bool delta, bias;
  torch::ScalarType dtype, param_dtype;
  bool misaligned;  // inputs start 2 bytes past a 16-byte boundary (the scalar path)
};
void PrintTo(const LnCase& c, std::ostream* os) {
  *os << c.rows << "x" << c.cols << (c.delta ? "_delta" : "") << (c.bias ? "_bias_" : "_") << c10::toString(c.dtype)
      << "_w" << c10::toString(c.param_dtype) << (c.misaligned ? "_misaligned" : "");
}

Tensor make(const LnCase& c, bool misaligned, double scale, double shift) {
  const Tensor v = torch::randn({c.rows, c.cols}) * scale + shift;
  if (!misaligned) return v.to(kCuda, c.dtype);
  Tensor buf = torch::empty({c.rows * c.cols + 8}, torch::TensorOptions(kCuda).dtype(c.dtype));
  Tensor view = buf.narrow(0, 1, c.rows * c.cols).view({c.rows, c.cols});
  view.copy_(v);
  return view;
}

class AddLayerNormCuda : public ::testing::TestWithParam<LnCase> {};

TEST_P(AddLayerNormCuda, MatchesFloat64ReferenceForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  const LnCase c = GetParam();
  const bool lowp = c.dtype != torch::kFloat;
  const double bound = lowp ? 8e-3 : 1e-5;
  const double pbound = c.param_dtype != torch::kFloat ? 8e-3 : 1e-5;
  for (int rep = 0; rep < 2; ++rep) {
    poison_allocator();
    const Tensor x = make(c, c.misaligned, 2.0, 0.5).requires_grad_();
    const Tensor d = make(c, c.misaligned, 1.0, 0.0).requires_grad_();
    const Tensor w = (torch::randn({c.cols}) * 0.5 + 1).to(kCuda, c.param_dtype).requires_grad_();
    const Tensor b = (torch::randn({c.cols}) * 0.1).to(kCuda, c.param_dtype).requires_grad_();
    const std::optional<Tensor> bias = c.bias ? std::optional<Tensor>(b) : std::nullopt;
    Tensor sum, y;
    if (c.delta) {
      std::tie(sum, y) = strobe::ops::add_layer_norm(x, d, w, bias, 1e-6);
      // x + delta computed in fp32 and rounded once, exactly as ATen's add.
      EXPECT_TRUE(torch::equal(sum, (x + d).detach())) << "sum";
    } else {
      y = strobe::ops::layer_norm(x, w, bias, 1e-6);
    }
    ASSERT_EQ(y.scalar_type(), c.dtype);
    const Tensor s64 = (c.delta ? sum : x).detach().to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor w64 = w.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor b64 = b.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor y64 = torch::layer_norm(s64, {c.cols}, w64, c.bias ? b64 : Tensor(), 1e-6);
    EXPECT_LT(rel_err(y, y64), bound) << "y";

    const Tensor gy = torch::randn({c.rows, c.cols}, torch::TensorOptions(kCuda).dtype(c.dtype));
    const Tensor gs = torch::randn({c.rows, c.cols}, torch::TensorOptions(kCuda).dtype(c.dtype));
    Tensor l = (y * gy).sum();
    if (c.delta) l = l + (sum * gs).sum();
    l.backward();
    (y64 * gy.to(torch::kCPU, torch::kDouble)).sum().backward();
    Tensor dx64 = s64.grad();
    if (c.delta) dx64 = dx64 + gs.to(torch::kCPU, torch::kDouble);
    EXPECT_LT(rel_err(x.grad(), dx64), bound) << "dx";
    if (c.delta) EXPECT_TRUE(torch::equal(x.grad(), d.grad())) << "ddelta == dx";
    EXPECT_EQ(w.grad().scalar_type(), c.param_dtype);
    EXPECT_LT(rel_err(w.grad(), w64.grad()), pbound) << "dweight";
    if (c.bias) EXPECT_LT(rel_err(b.grad(), b64.grad()), pbound) << "dbias";
    else EXPECT_FALSE(b.grad().defined());

    // Deterministic parameter gradients: the same inputs give bitwise the same result.
    const Tensor dw1 = w.grad().clone();
    w.mutable_grad() = Tensor();
    Tensor y2 = c.delta ? std::get<1>(strobe::ops::add_layer_norm(x, d, w, bias, 1e-6))
                        : strobe::ops::layer_norm(x, w, bias, 1e-6);
    (y2 * gy).sum().backward();
    EXPECT_TRUE(torch::equal(w.grad(), dw1)) << "dweight not deterministic";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AddLayerNormCuda,
    ::testing::Values(LnCase{4096, 1024, true, true, torch::kBFloat16, torch::kBFloat16, false},
                      LnCase{4096, 1024, true, false, torch::kBFloat16, torch::kBFloat16, false},
                      LnCase{1000, 1024, false, true, torch::kBFloat16, torch::kFloat, false},
                      LnCase{515, 4096, true, true, torch::kFloat, torch::kFloat, false},
                      LnCase{300, 4096, true, true, torch::kBFloat16, torch::kBFloat16, true},
                      LnCase{257, 1000, true, true, torch::kFloat, torch::kFloat, false},
                      LnCase{129, 1000, true, false, torch::kBFloat16, torch::kBFloat16, false},
                      LnCase{1, 7, true, true, torch::kFloat, torch::kFloat, false},
                      LnCase{1, 1, true, true, torch::kBFloat16, torch::kBFloat16, false},
                      LnCase{2048, 768, true, true, torch::kHalf, torch::kHalf, false},
                      LnCase{64, 1024, true, true, torch::kFloat, torch::kBFloat16, true},
                      LnCase{33, 4095, false, true, torch::kFloat, torch::kFloat, false}));

TEST(AddLayerNormCudaNan, NanInputsComeOutNan) {
  SKIP_WITHOUT_CUDA();
  const auto o = torch::TensorOptions(kCuda).dtype(torch::kBFloat16);
  Tensor x = torch::randn({8, 1024}, o);
  x[3][100] = NAN;
  const Tensor w = torch::ones({1024}, o).requires_grad_(), b = torch::zeros({1024}, o).requires_grad_();
  const Tensor xr = x.clone().requires_grad_();
  auto [s, y] = strobe::ops::add_layer_norm(xr, torch::zeros_like(x), w, b, 1e-5);
  const Tensor yc = y.cpu();
  EXPECT_TRUE(torch::isnan(yc[3]).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(yc[2]).all().item<bool>());
  Tensor gy = torch::randn({8, 1024}, o);
  y.backward(gy);
  EXPECT_TRUE(torch::isnan(xr.grad()[3].cpu()).all().item<bool>());
  EXPECT_TRUE(torch::isnan(w.grad().cpu()).any().item<bool>()) << "a NaN row must reach dweight";
  // NaN in the incoming gradient reaches dbias.
  const Tensor x2 = torch::randn({8, 1024}, o).requires_grad_();
  const Tensor w2 = torch::ones({1024}, o).requires_grad_(), b2 = torch::zeros({1024}, o).requires_grad_();
  gy = torch::randn({8, 1024}, o);
  gy[5][9] = NAN;
  strobe::ops::layer_norm(x2, w2, b2, 1e-5).backward(gy);
  EXPECT_TRUE(torch::isnan(b2.grad()[9]).item<bool>());
}

TEST(AddLayerNormCudaErrors, TooWideAndDoubleAreErrors) {
  SKIP_WITHOUT_CUDA();
  const auto o = torch::TensorOptions(kCuda);
  EXPECT_THROW(strobe::ops::layer_norm(torch::randn({2, 4097}, o), torch::ones({4097}, o)), c10::Error);
  EXPECT_THROW(strobe::ops::layer_norm(torch::randn({2, 16}, o.dtype(torch::kDouble)), torch::ones({16}, o)),
               c10::Error);
}

// ---- add_rms_norm / rms_norm (the RMS mode of the same kernels) ---------------------------------
// Bounds: fp32 1e-5; bf16 / fp16 y (rounded twice: the normalised row, then its product with the
// weight) 1e-2, dx 8e-3, dweight 8e-3 when the weight is 16-bit (1e-5 in fp32). Against Hugging
// Face's ATen sequence on the same GPU: within one 16-bit rounding step of it (8e-3), exact never
// asked (rsqrt and the order of the row sum differ).
class AddRmsNormCuda : public ::testing::TestWithParam<LnCase> {};

TEST_P(AddRmsNormCuda, MatchesFloat64ReferenceForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  const LnCase c = GetParam();
  const bool lowp = c.dtype != torch::kFloat;
  const double pbound = c.param_dtype != torch::kFloat ? 8e-3 : 1e-5;
  for (int rep = 0; rep < 2; ++rep) {
    poison_allocator();
    const Tensor x = make(c, c.misaligned, 2.0, 0.5).requires_grad_();
    const Tensor d = make(c, c.misaligned, 1.0, 0.0).requires_grad_();
    const Tensor w = (torch::randn({c.cols}) * 0.5 + 1).to(kCuda, c.param_dtype).requires_grad_();
    Tensor sum, y;
    if (c.delta) {
      std::tie(sum, y) = strobe::ops::add_rms_norm(x, d, w, 1e-6);
      EXPECT_TRUE(torch::equal(sum, (x + d).detach())) << "sum";
    } else {
      y = strobe::ops::rms_norm(x, w, 1e-6);
    }
    ASSERT_EQ(y.scalar_type(), c.dtype);
    const Tensor in = (c.delta ? sum : x).detach();
    const Tensor xf = in.to(torch::kFloat);
    const Tensor hf = w.detach() * (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + 1e-6)).to(c.dtype);
    EXPECT_LT(rel_err(y, hf.to(torch::kDouble)), lowp ? 8e-3 : 1e-6) << "y against Hugging Face's ops";
    const Tensor s64 = in.to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor w64 = w.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor y64 = w64 * (s64 * torch::rsqrt(s64.pow(2).mean(-1, true) + 1e-6));
    EXPECT_LT(rel_err(y, y64), lowp ? 1e-2 : 1e-5) << "y";

    const Tensor gy = torch::randn({c.rows, c.cols}, torch::TensorOptions(kCuda).dtype(c.dtype));
    const Tensor gs = torch::randn({c.rows, c.cols}, torch::TensorOptions(kCuda).dtype(c.dtype));
    Tensor l = (y * gy).sum();
    if (c.delta) l = l + (sum * gs).sum();
    l.backward();
    (y64 * gy.to(torch::kCPU, torch::kDouble)).sum().backward();
    Tensor dx64 = s64.grad();
    if (c.delta) dx64 = dx64 + gs.to(torch::kCPU, torch::kDouble);
    EXPECT_LT(rel_err(x.grad(), dx64), lowp ? 8e-3 : 1e-5) << "dx";
    if (c.delta) EXPECT_TRUE(torch::equal(x.grad(), d.grad())) << "ddelta == dx";
    EXPECT_EQ(w.grad().scalar_type(), c.param_dtype);
    EXPECT_LT(rel_err(w.grad(), w64.grad()), lowp ? 8e-3 : pbound) << "dweight";

    const Tensor dw1 = w.grad().clone();
    w.mutable_grad() = Tensor();
    Tensor y2 = c.delta ? std::get<1>(strobe::ops::add_rms_norm(x, d, w, 1e-6)) : strobe::ops::rms_norm(x, w, 1e-6);
    (y2 * gy).sum().backward();
    EXPECT_TRUE(torch::equal(w.grad(), dw1)) << "dweight not deterministic";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AddRmsNormCuda,
    ::testing::Values(LnCase{16384, 2048, true, false, torch::kBFloat16, torch::kBFloat16, false},
                      LnCase{4096, 2048, false, false, torch::kBFloat16, torch::kBFloat16, false},
                      LnCase{515, 4096, true, false, torch::kFloat, torch::kFloat, false},
                      LnCase{300, 4096, true, false, torch::kBFloat16, torch::kBFloat16, true},
                      LnCase{129, 1000, true, false, torch::kBFloat16, torch::kBFloat16, false},
                      LnCase{1, 1, true, false, torch::kFloat, torch::kFloat, false},
                      LnCase{2048, 768, true, false, torch::kHalf, torch::kHalf, false},
                      LnCase{64, 1024, true, false, torch::kFloat, torch::kBFloat16, true}));

TEST(AddRmsNormCudaNan, NanComesOutNanAndWideOrPromotingInputsAreErrors) {
  SKIP_WITHOUT_CUDA();
  const auto o = torch::TensorOptions(kCuda).dtype(torch::kBFloat16);
  Tensor x = torch::randn({8, 2048}, o);
  x[3][100] = NAN;
  const Tensor w = torch::ones({2048}, o).requires_grad_();
  const Tensor xr = x.clone().requires_grad_();
  auto [s, y] = strobe::ops::add_rms_norm(xr, torch::zeros_like(x), w, 1e-5);
  const Tensor yc = y.cpu();
  EXPECT_TRUE(torch::isnan(yc[3]).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(yc[2]).all().item<bool>());
  y.backward(torch::randn({8, 2048}, o));
  EXPECT_TRUE(torch::isnan(xr.grad()[3].cpu()).all().item<bool>());
  EXPECT_TRUE(torch::isnan(w.grad().cpu()).any().item<bool>()) << "a NaN row must reach dweight";
  // A NaN in the incoming gradient reaches dx's row and dweight.
  const Tensor x2 = torch::randn({8, 2048}, o).requires_grad_();
  const Tensor w2 = torch::ones({2048}, o).requires_grad_();
  Tensor gy = torch::randn({8, 2048}, o);
  gy[5][9] = NAN;
  strobe::ops::rms_norm(x2, w2, 1e-5).backward(gy);
  EXPECT_TRUE(torch::isnan(x2.grad()[5].cpu()).all().item<bool>());
  EXPECT_TRUE(torch::isnan(w2.grad()[9].cpu()).item<bool>());
  EXPECT_THROW(strobe::ops::rms_norm(torch::randn({2, 4097}, o), torch::ones({4097}, o)), c10::Error);
  EXPECT_THROW(strobe::ops::rms_norm(torch::randn({2, 16}, o), torch::ones({16}, o.dtype(torch::kFloat))), c10::Error);
}

// add_layer_norm_amax / add_rms_norm_amax against the plain ops (check_norm_amax, op_test_util.h), in the
// kernels' two layouts: 16-byte vectors (2048 columns, Llama's width), one element a thread (100).
TEST(AddNormAmaxCuda, TheAmaxVariantsGiveTheSameValuesAndGradientsAndMaxOfY) {
  SKIP_WITHOUT_CUDA();
  check_norm_amax(kCuda, torch::kBFloat16, 257, 2048, "bf16 2048");
  check_norm_amax(kCuda, torch::kBFloat16, 33, 100, "bf16 100");
  check_norm_amax(kCuda, torch::kFloat, 64, 1024, "fp32 1024");
}

struct CeCase {
  int64_t n, v;
  const char* reduction;
  torch::ScalarType dtype;
};
void PrintTo(const CeCase& c, std::ostream* os) {
  *os << c.n << "x" << c.v << "_" << c.reduction << "_" << c10::toString(c.dtype);
}

class CrossEntropyCuda : public ::testing::TestWithParam<CeCase> {};

// Loss fp32 from the given logits: 1e-5 against double; dlogits in the logits' dtype: fp32 1e-5,
// bf16 / fp16 8e-3.
TEST_P(CrossEntropyCuda, MatchesFloat64Reference) {
  SKIP_WITHOUT_CUDA();
  const CeCase c = GetParam();
  poison_allocator();
  const Tensor logits = (torch::randn({c.n, c.v}) * 4).to(kCuda, c.dtype).requires_grad_();
  Tensor target = torch::randint(0, c.v, {c.n}, torch::kLong);
  if (c.n > 2) target.index_put_({torch::indexing::Slice(0, c.n, 5)}, -100);
  target = target.to(kCuda);
  const Tensor loss = strobe::ops::cross_entropy(logits, target, -100, c.reduction);
  ASSERT_EQ(loss.scalar_type(), torch::kFloat);
  const Tensor l64 = logits.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
  auto opts = torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100);
  const std::string r = c.reduction;
  if (r == "sum") opts.reduction(torch::kSum);
  if (r == "none") opts.reduction(torch::kNone);
  const Tensor ref = torch::nn::functional::cross_entropy(l64, target.cpu(), opts);
  EXPECT_LT(rel_err(loss, ref), 1e-5) << "loss";
  const Tensor g = torch::rand(ref.sizes()) + 0.5;
  (loss * g.to(kCuda, torch::kFloat)).sum().backward();
  (ref * g.to(torch::kDouble)).sum().backward();
  ASSERT_EQ(logits.grad().scalar_type(), c.dtype);
  EXPECT_LT(rel_err(logits.grad(), l64.grad()), c.dtype == torch::kFloat ? 1e-5 : 8e-3) << "dlogits";
  // Ignored rows get exactly zero gradient.
  if (c.n > 2) EXPECT_EQ(logits.grad()[0].abs().max().item<float>(), 0.f);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyCuda,
                         ::testing::Values(CeCase{4096, 1000, "mean", torch::kBFloat16},
                                           CeCase{1024, 1000, "mean", torch::kFloat},
                                           CeCase{2048, 50257, "mean", torch::kBFloat16},
                                           CeCase{1024, 1024, "sum", torch::kHalf},
                                           CeCase{7, 3, "none", torch::kFloat}, CeCase{1, 1, "mean", torch::kFloat},
                                           CeCase{333, 517, "none", torch::kBFloat16}));

TEST(CrossEntropyCudaNan, NanLogitsAndBadTargetsGiveNan) {
  SKIP_WITHOUT_CUDA();
  const auto o = torch::TensorOptions(kCuda).dtype(torch::kBFloat16);
  Tensor logits = torch::randn({6, 100}, o);
  logits[4][50] = NAN;
  const Tensor t = torch::tensor({1, 2, 3, 4, 5, 6}, torch::kLong).to(kCuda);
  EXPECT_TRUE(torch::isnan(strobe::ops::cross_entropy(logits, t).cpu()).item<bool>());
  const Tensor rows = strobe::ops::cross_entropy(logits, t, -100, "none").cpu();
  EXPECT_TRUE(torch::isnan(rows[4]).item<bool>());
  EXPECT_TRUE(torch::isfinite(rows[3]).item<bool>());
  // A target outside [0, V): NaN loss and gradient, no device assert.
  const Tensor l2 = torch::randn({3, 100}, o).requires_grad_();
  const Tensor loss = strobe::ops::cross_entropy(l2, torch::tensor({1, 100, 2}, torch::kLong).to(kCuda));
  EXPECT_TRUE(torch::isnan(loss.cpu()).item<bool>());
  loss.backward();
  EXPECT_TRUE(torch::isnan(l2.grad()[1].cpu()).all().item<bool>());
}

// fused_mlp on CUDA (cuBLASLt GELU_AUX_BIAS / DGELU_BGRAD epilogues) against float64 autograd through
// linear / gelu(tanh) / linear. Bounds: fp32 1e-4 (cuBLASLt's GELU epilogue evaluates tanh in fp32 with
// its own formula), bf16 1.5e-2 (pre and act are stored in bf16, weight gradients sum over rows of
// bf16 products).
struct MlpCase {
  int64_t rows, c, h, n;
  torch::ScalarType dtype;
};
void PrintTo(const MlpCase& m, std::ostream* os) {
  *os << m.rows << "x" << m.c << "_" << m.h << "_" << m.n << "_" << c10::toString(m.dtype);
}
class FusedMlpCuda : public ::testing::TestWithParam<MlpCase> {};

TEST_P(FusedMlpCuda, MatchesFloat64Reference) {
  SKIP_WITHOUT_CUDA();
  const MlpCase m = GetParam();
  poison_allocator();
  auto mk = [&](std::vector<int64_t> s, double sc) {
    return (torch::randn(s) * sc).to(kCuda, m.dtype).requires_grad_();
  };
  const Tensor x = mk({m.rows, m.c}, 1.0), w1 = mk({m.h, m.c}, 1.0 / std::sqrt(double(m.c))), b1 = mk({m.h}, 0.1);
  const Tensor w2 = mk({m.n, m.h}, 1.0 / std::sqrt(double(m.h))), b2 = mk({m.n}, 0.1);
  const Tensor y = strobe::ops::fused_mlp(x, w1, b1, w2, b2);
  ASSERT_EQ(y.scalar_type(), m.dtype);
  std::vector<Tensor> d64;
  for (const Tensor& t : {x, w1, b1, w2, b2}) d64.push_back(t.detach().to(torch::kCPU, torch::kDouble).requires_grad_());
  const Tensor y64 = torch::linear(torch::gelu(torch::linear(d64[0], d64[1], d64[2]), "tanh"), d64[3], d64[4]);
  const double bound = m.dtype == torch::kFloat ? 1e-4 : 1.5e-2;
  EXPECT_LT(rel_err(y, y64), bound) << "y";
  const Tensor g = torch::randn({m.rows, m.n});
  (y * g.to(kCuda, m.dtype)).sum().backward();
  (y64 * g.to(torch::kDouble)).sum().backward();
  const char* names[] = {"dx", "dw1", "db1", "dw2", "db2"};
  const Tensor got[] = {x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()};
  for (int i = 0; i < 5; ++i) EXPECT_LT(rel_err(got[i], d64[i].grad()), bound) << names[i];
}

INSTANTIATE_TEST_SUITE_P(Shapes, FusedMlpCuda,
                         ::testing::Values(MlpCase{4096, 1024, 4096, 1024, torch::kBFloat16},
                                           MlpCase{777, 256, 1024, 256, torch::kBFloat16},
                                           MlpCase{512, 256, 1024, 256, torch::kFloat},
                                           MlpCase{1, 8, 16, 8, torch::kBFloat16},
                                           MlpCase{100, 64, 256, 64, torch::kHalf}));

TEST(FusedMlpCudaErrors, NanPropagatesAndOddWidthsAreErrors) {
  SKIP_WITHOUT_CUDA();
  const auto o = torch::TensorOptions(kCuda).dtype(torch::kBFloat16);
  Tensor x = torch::randn({16, 64}, o);
  x[5][7] = NAN;
  const Tensor y = strobe::ops::fused_mlp(x, torch::randn({256, 64}, o), torch::zeros({256}, o), torch::randn({64, 256}, o),
                                          torch::zeros({64}, o)).cpu();
  EXPECT_TRUE(torch::isnan(y[5]).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(y[4]).all().item<bool>());
  EXPECT_THROW(strobe::ops::fused_mlp(torch::randn({4, 12}, o), torch::randn({20, 12}, o), torch::zeros({20}, o),
                                      torch::randn({12, 20}, o), torch::zeros({12}, o)),
               c10::Error);
}

}  // namespace
