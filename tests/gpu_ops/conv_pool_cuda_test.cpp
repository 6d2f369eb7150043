// conv3x3_maxpool_relu's CUDA kernels against float64 references (fresh random inputs, the caching
// allocator poisoned with NaN first so an unwritten output element fails; NaN never passes):
//   y against conv2d/max_pool2d/relu in double; grad_x, grad_w, grad_b against the op's CPU
//   backward in double given the kernel's own argmax mask (a near-tie resolved differently in fp32
//   and fp64 must not decide the test), and the tie rule against PyTorch's CUDA max-pool.
#include <cmath>

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/gpu_test_util.h"

namespace {

using torch::Tensor;

using strobe::testing::kCuda;
using strobe::testing::poison_allocator;
using strobe::testing::rel_err;

using FwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double,
                                          at::ScalarType);
using BwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, double, bool);
std::tuple<Tensor, Tensor> fwd(const Tensor& x, const Tensor& w, const Tensor& b, double scale,
                               at::ScalarType out) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::conv3x3_maxpool_relu_fwd", "")
                             .typed<FwdSig>();
  return op.call(x, w, b, scale, out);
}
std::tuple<Tensor, Tensor, Tensor> bwd(const Tensor& gy, const Tensor& x, const Tensor& w,
                                       const Tensor& mask, double scale, bool input_grad) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::conv3x3_maxpool_relu_bwd", "")
                             .typed<BwdSig>();
  return op.call(gy, x, w, mask, scale, input_grad);
}

struct Case {
  int64_t n, cin, cout, h, w;
  torch::ScalarType dtype;
};

// Readable, deterministic test names (the default printer dumps the struct's padding bytes).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.n << "x" << c.cin << "to" << c.cout << "_" << c.h << "x" << c.w << "_" << c10::toString(c.dtype);
}

class ConvPoolCuda : public ::testing::TestWithParam<Case> {};

TEST_P(ConvPoolCuda, MatchesFloat64Reference) {
  SKIP_WITHOUT_CUDA();
  const Case c = GetParam();
  const bool bf16 = c.dtype == torch::kBFloat16;
  const bool u8 = c.dtype == torch::kUInt8;
  const double scale = u8 ? 1.0 / 255.0 : 1.0;
  for (int rep = 0; rep < 2; ++rep) {
    poison_allocator();
    const auto dopt = torch::TensorOptions().dtype(torch::kDouble);
    Tensor x64 = u8 ? torch::randint(0, 256, {c.n, c.cin, c.h, c.w}, dopt)
                    : torch::randn({c.n, c.cin, c.h, c.w}, dopt);
    const Tensor x = x64.to(kCuda, c.dtype);
    x64 = x.to(torch::kCPU, torch::kDouble);  // the values the kernel sees (bf16-rounded)
    const Tensor w = (torch::randn({c.cout, c.cin, 3, 3}) / std::sqrt(9.0 * c.cin)).to(kCuda);
    const Tensor b = (torch::randn({c.cout}) * 0.1).to(kCuda);
    const auto out = bf16 ? torch::kBFloat16 : torch::kFloat;
    auto [y, mask] = fwd(x, w, b, scale, out);
    ASSERT_EQ(y.scalar_type(), out);
    const Tensor w64 = w.to(torch::kCPU, torch::kDouble), b64 = b.to(torch::kCPU, torch::kDouble);
    const Tensor y_ref = strobe::ops::conv3x3_maxpool_relu_reference(x64, w64, b64, scale);
    EXPECT_LT(rel_err(y, y_ref), bf16 ? 8e-3 : 1e-5) << "y";
    // The mask against the double reference's: differences only at near-ties (rare).
    auto [y64, mask64] = fwd(x64, w64, b64, scale, torch::kDouble);
    const double differ = mask.cpu().ne(mask64).to(torch::kDouble).mean().item<double>();
    EXPECT_LT(differ, 1e-3) << "mask";

    const Tensor gy = torch::randn(y.sizes(), torch::TensorOptions(kCuda).dtype(out));
    const bool input_grad = !u8;
    auto [gx, gw, gb] = bwd(gy, x, w, mask, scale, input_grad);
    auto [gx_ref, gw_ref, gb_ref] =
        bwd(gy.to(torch::kCPU, torch::kDouble), x64, w64, mask.cpu(), scale, input_grad);
    if (input_grad) {
      ASSERT_EQ(gx.scalar_type(), c.dtype);
      EXPECT_LT(rel_err(gx, gx_ref), bf16 ? 8e-3 : 1e-5) << "grad_x";
    } else {
      EXPECT_FALSE(gx.defined());
    }
    EXPECT_LT(rel_err(gw, gw_ref), 1e-5) << "grad_w";
    EXPECT_LT(rel_err(gb, gb_ref), 1e-5) << "grad_b";
    // Deterministic: no atomics in the weight-gradient reduction.
    auto [gx2, gw2, gb2] = bwd(gy, x, w, mask, scale, input_grad);
    EXPECT_TRUE(torch::equal(gw, gw2));
    EXPECT_TRUE(torch::equal(gb, gb2));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ConvPoolCuda,
    ::testing::Values(Case{3, 1, 4, 18, 18, torch::kFloat}, Case{3, 1, 4, 18, 18, torch::kUInt8},
                      Case{2, 4, 16, 19, 17, torch::kFloat}, Case{2, 4, 16, 34, 66, torch::kBFloat16},
                      Case{2, 16, 64, 21, 32, torch::kFloat}, Case{4, 16, 64, 64, 64, torch::kBFloat16},
                      Case{2, 64, 256, 16, 16, torch::kFloat}, Case{5, 3, 6, 9, 7, torch::kFloat},
                      Case{64, 1, 4, 256, 256, torch::kUInt8}));

TEST(ConvPoolCudaOp, AutogradTiesAndUint8MatchPyTorchOnTheGpu) {
  SKIP_WITHOUT_CUDA();
  poison_allocator();
  // x = 0: every window is a four-way tie; PyTorch's max-pool takes the first maximum.
  const auto opt = torch::TensorOptions(kCuda);
  const Tensor x = torch::zeros({2, 4, 6, 10}, opt), w = torch::randn({16, 4, 3, 3}, opt);
  const Tensor b = torch::randn({16}, opt);
  const Tensor gy = torch::randn({2, 16, 3, 5}, opt);
  Tensor xa = x.clone().requires_grad_(true), wa = w.clone().requires_grad_(true),
         ba = b.clone().requires_grad_(true);
  Tensor xr = x.clone().requires_grad_(true), wr = w.clone().requires_grad_(true),
         br = b.clone().requires_grad_(true);
  strobe::ops::conv3x3_maxpool_relu(xa, wa, ba).backward(gy);
  strobe::ops::conv3x3_maxpool_relu_reference(xr, wr, br).backward(gy);
  EXPECT_LT(rel_err(xa.grad(), xr.grad()), 1e-5);
  EXPECT_LT(rel_err(wa.grad(), wr.grad()), 1e-5);
  EXPECT_LT(rel_err(ba.grad(), br.grad()), 1e-5);
  EXPECT_GT(xa.grad().abs().sum().item<double>(), 0.0);
  // uint8 input, bf16 output, weight gradients only (integer x needs none).
  const Tensor img = torch::randint(0, 256, {3, 1, 18, 18}, opt.dtype(torch::kUInt8));
  Tensor w1 = torch::randn({4, 1, 3, 3}, opt).requires_grad_(true);
  Tensor b1 = torch::randn({4}, opt).requires_grad_(true);
  const Tensor y = strobe::ops::conv3x3_maxpool_relu(img, w1, b1, 1.0 / 255, torch::kBFloat16);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  y.to(torch::kFloat).sum().backward();
  ASSERT_TRUE(w1.grad().defined() && b1.grad().defined());
  EXPECT_TRUE(torch::isfinite(w1.grad()).all().item<bool>());
}

TEST(ConvPoolCudaOp, SmallShapeForMemcheck) {
  // Run under compute-sanitizer --tool memcheck (docs/OPS.md): odd sizes, every kernel.
  SKIP_WITHOUT_CUDA();
  const auto opt = torch::TensorOptions(kCuda);
  for (const auto& s : std::vector<std::array<int64_t, 5>>{{3, 1, 4, 18, 18}, {2, 4, 16, 7, 9},
                                                           {1, 16, 64, 5, 6}}) {
    Tensor x = torch::randn({s[0], s[1], s[3], s[4]}, opt).requires_grad_(true);
    Tensor w = torch::randn({s[2], s[1], 3, 3}, opt).requires_grad_(true);
    Tensor b = torch::randn({s[2]}, opt).requires_grad_(true);
    strobe::ops::conv3x3_maxpool_relu(x, w, b, 1.0, torch::kBFloat16).to(torch::kFloat).sum().backward();
    EXPECT_TRUE(torch::isfinite(x.grad()).all().item<bool>());
    EXPECT_TRUE(torch::isfinite(w.grad()).all().item<bool>());
  }
}

}  // namespace
