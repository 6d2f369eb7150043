// swiglu's CUDA kernels against float64 (on the CPU) and against transformers' ATen ops on the same GPU,
// the caching allocator poisoned with NaN first so an unwritten element fails. Bounds: fp32 1e-6;
// bf16 / fp16 8e-3 against float64 (one rounding of silu, one of the product; the backward's two).
// Against ATen's own CUDA ops the results may differ by one rounding where ATen's compiled kernel
// fuses a multiply-add (silu's backward): in 16-bit types at most 1% of the elements, each within one
// ulp; in fp32 most elements of d gate move by an ulp (1e-6 relative), d up is equal.
// Shapes: llama's [16384, 2 x 8192] bf16, odd widths (the scalar path), fp32, fp16.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/gpu_test_util.h"

namespace {

using torch::Tensor;

using strobe::testing::kCuda;
using strobe::testing::poison_allocator;
using strobe::testing::rel_err;

struct SwCase {
  int64_t rows, f;
  torch::ScalarType dtype;
};
void PrintTo(const SwCase& c, std::ostream* os) { *os << c.rows << "x" << c.f << "_" << c10::toString(c.dtype); }
class SwigluCuda : public ::testing::TestWithParam<SwCase> {};

// Fraction of elements where a and b differ.
double mismatch(const Tensor& a, const Tensor& b) { return (a != b).sum().item<double>() / std::max<int64_t>(1, a.numel()); }

TEST_P(SwigluCuda, MatchesFloat64AndAtenForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  const SwCase c = GetParam();
  const bool lowp = c.dtype != torch::kFloat;
  const double bound = lowp ? 8e-3 : 1e-6;
  for (int rep = 0; rep < 2; ++rep) {
    poison_allocator();
    const auto o = torch::TensorOptions(kCuda).dtype(c.dtype);
    const Tensor gu = (torch::randn({c.rows, 2 * c.f}, o) * 3).requires_grad_();
    const Tensor y = strobe::ops::swiglu(gu);
    ASSERT_EQ(y.scalar_type(), c.dtype);
    const Tensor gate = gu.detach().narrow(-1, 0, c.f).clone().requires_grad_();
    const Tensor up = gu.detach().narrow(-1, c.f, c.f).clone().requires_grad_();
    const Tensor ref = torch::silu(gate) * up;
    EXPECT_LT(mismatch(y, ref), 0.01) << "y vs ATen";
    EXPECT_LT(rel_err(y, ref.to(torch::kDouble)), lowp ? 8e-3 : 1e-6) << "y vs ATen";
    const Tensor g64 = gu.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor y64 = torch::silu(g64.narrow(-1, 0, c.f)) * g64.narrow(-1, c.f, c.f);
    EXPECT_LT(rel_err(y, y64), bound) << "y vs float64";
    const Tensor dy = torch::randn(y.sizes(), o);
    y.backward(dy);
    ref.backward(dy);
    y64.backward(dy.to(torch::kCPU, torch::kDouble));
    EXPECT_LT(rel_err(gu.grad(), g64.grad()), bound) << "d gate_up vs float64";
    if (lowp) {
      EXPECT_LT(mismatch(gu.grad().narrow(-1, 0, c.f), gate.grad()), 0.01) << "d gate vs ATen";
      EXPECT_LT(mismatch(gu.grad().narrow(-1, c.f, c.f), up.grad()), 0.01) << "d up vs ATen";
    } else {  // fp32: a fused multiply-add moves most elements by an ulp, nothing more
      EXPECT_LT(rel_err(gu.grad().narrow(-1, 0, c.f), gate.grad().to(torch::kDouble)), 1e-6) << "d gate vs ATen";
      EXPECT_TRUE(torch::equal(gu.grad().narrow(-1, c.f, c.f), up.grad())) << "d up vs ATen";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwigluCuda,
                         ::testing::Values(SwCase{16384, 8192, torch::kBFloat16}, SwCase{333, 1000, torch::kBFloat16},
                                           SwCase{77, 13, torch::kBFloat16}, SwCase{512, 1376, torch::kFloat},
                                           SwCase{100, 64, torch::kHalf}, SwCase{1, 1, torch::kFloat}));

TEST(SwigluCudaNan, NanStaysInItsColumnAndOddWidthsAreErrors) {
  SKIP_WITHOUT_CUDA();
  const auto o = torch::TensorOptions(kCuda).dtype(torch::kBFloat16);
  Tensor gu = torch::randn({8, 2 * 64}, o);
  gu[2][64 + 5] = NAN;  // up, column 5
  const Tensor y = strobe::ops::swiglu(gu).cpu();
  EXPECT_TRUE(torch::isnan(y[2][5]).item<bool>());
  EXPECT_EQ(torch::isnan(y).sum().item<int64_t>(), 1);
  EXPECT_THROW(strobe::ops::swiglu(torch::randn({4, 7}, o)), c10::Error);
  EXPECT_THROW(strobe::ops::swiglu(torch::randn({4, 8}, o.dtype(torch::kDouble))), c10::Error);
}

}  // namespace
