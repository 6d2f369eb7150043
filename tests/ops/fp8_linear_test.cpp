// fp8_linear on the CPU (ATen's _scaled_mm) against a float64 reference of the same quantized math:
// y = deq(q_x) deq(q_w)^T + b, dx = deq(q_dy) deq(q_w), dw = deq(q_dy)^T deq(q_x), db = sum dy, where
// deq(q) = q * scale_inv of fp8_quantize (e4m3 for x and the weight, e5m2 for the output gradient;
// fp8_quantize itself is held to its own float64 reference in fp8_test.cpp). Then against the
// unquantized linear within the error the formats allow, the gradients autograd asks for, token
// counts that are not a multiple of 16, NaN / Inf, zeros, empty batches, Meta shapes and bad arguments.
#include <cmath>

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/ops/op_test_util.h"

namespace {

using torch::Tensor;
using strobe::testing::fp8_dequantized;
using strobe::testing::rel_err;

struct Fp8LinearCase {
  torch::ScalarType dtype;
  std::vector<int64_t> x_shape;  // [..., K]
  int64_t n;
  bool bias;
  double bound;  // y, dx, dw against the float64 reference of the quantized math
};

// The forward and the backward against the quantized math in float64; fp32 inputs leave only the
// fp32 accumulation, 16-bit ones one rounding of each output.
TEST(Fp8Linear, EqualsTheFloat64ReferenceOfTheQuantizedMathForwardAndBackward) {
  const std::vector<Fp8LinearCase> cases = {
      {torch::kFloat, {3, 5, 64}, 48, true, 2e-6},     // 15 tokens: d weight's reduction padded to 16
      {torch::kFloat, {32, 128}, 16, false, 2e-6},     // 32 tokens: no padding
      {torch::kBFloat16, {2, 9, 64}, 32, true, 4e-3},  // bias in the GEMM's epilogue
      {torch::kHalf, {7, 32}, 64, true, 2e-3},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.dtype << " x " << torch::IntArrayRef(c.x_shape) << " N " << c.n);
    torch::manual_seed(c.n + c.x_shape.front());
    const int64_t k = c.x_shape.back();
    const Tensor x = torch::randn(c.x_shape).to(c.dtype).requires_grad_();
    const Tensor w = (torch::randn({c.n, k}) * 0.1).to(c.dtype).requires_grad_();
    const Tensor b = torch::randn({c.n}).to(c.dtype).requires_grad_();
    const Tensor y = strobe::ops::fp8_linear(x, w, c.bias ? std::optional<Tensor>(b) : std::nullopt);
    ASSERT_EQ(y.scalar_type(), c.dtype);
    std::vector<int64_t> y_shape = c.x_shape;
    y_shape.back() = c.n;
    ASSERT_EQ(y.sizes(), torch::IntArrayRef(y_shape));

    const Tensor xd = fp8_dequantized(x.detach(), torch::kFloat8_e4m3fn), wd = fp8_dequantized(w.detach(), torch::kFloat8_e4m3fn);
    Tensor y_ref = torch::matmul(xd, wd.t());
    if (c.bias) y_ref = y_ref + b.detach().to(torch::kDouble);
    EXPECT_LT(rel_err(y, y_ref), c.bound);

    const Tensor g = torch::randn(y_shape).to(c.dtype);
    y.backward(g);
    const Tensor gd = fp8_dequantized(g, torch::kFloat8_e5m2);
    const Tensor g2 = gd.reshape({-1, c.n}), x2 = xd.reshape({-1, k});
    ASSERT_TRUE(x.grad().defined() && w.grad().defined());
    EXPECT_EQ(x.grad().scalar_type(), c.dtype);
    EXPECT_EQ(w.grad().scalar_type(), c.dtype);
    EXPECT_LT(rel_err(x.grad(), torch::matmul(gd, wd)), c.bound) << "d x";
    EXPECT_LT(rel_err(w.grad(), torch::matmul(g2.t(), x2)), c.bound) << "d weight";
    if (c.bias) {
      EXPECT_LT(rel_err(b.grad(), g.to(torch::kDouble).reshape({-1, c.n}).sum(0)), c.bound) << "d bias";
    } else {
      EXPECT_FALSE(b.grad().defined());
    }
  }
}

// Against the linear layer without quantization: e4m3 keeps 3 mantissa bits (a relative error up to
// 2^-4 an operand), e5m2 2: measured 2.2% (y), 5.8% (dx) and 5.9% (dw) on these shapes.
TEST(Fp8Linear, StaysWithinTheFormatsErrorOfTheUnquantizedLinear) {
  torch::manual_seed(3);
  const Tensor x = torch::randn({4, 64, 256}, torch::kDouble).requires_grad_();
  const Tensor w = (torch::randn({128, 256}, torch::kDouble) * 0.05).requires_grad_();
  const Tensor b = torch::randn({128}, torch::kDouble);
  const Tensor xf = x.detach().to(torch::kFloat).requires_grad_(), wf = w.detach().to(torch::kFloat).requires_grad_();
  const Tensor y = strobe::ops::fp8_linear(xf, wf, b.to(torch::kFloat));
  const Tensor y_ref = torch::nn::functional::linear(x, w, b);
  const Tensor g = torch::randn(y.sizes(), torch::kDouble);
  y.backward(g.to(torch::kFloat));
  y_ref.backward(g);
  const double ey = rel_err(y, y_ref), edx = rel_err(xf.grad(), x.grad()), edw = rel_err(wf.grad(), w.grad());
  EXPECT_LT(ey, 0.05);
  EXPECT_LT(edx, 0.08);
  EXPECT_LT(edw, 0.08);
  EXPECT_GT(ey, 1e-3) << "no quantization error at all: the GEMM did not run in float8";
}

// The op's forward half: (y, x_t, x_scale_inv, w_t, w_scale_inv).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fwd(const Tensor& x, const Tensor& w, bool save_x_t, bool save_w_t) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::fp8_linear_fwd", "")
                             .typed<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
                                 const Tensor&, const Tensor&, const std::optional<Tensor>&, bool, bool,
                                 const std::optional<Tensor>&)>();
  return op.call(x, w, std::nullopt, save_x_t, save_w_t, std::nullopt);
}

// Only the gradients asked for, and only the float8 copies they need saved; edges.
TEST(Fp8Linear, GradientsAsAskedAndTheEdges) {
  torch::manual_seed(5);
  const Tensor x = torch::randn({10, 32}), w = torch::randn({16, 32});
  // A frozen weight: d x only, and the forward keeps no x^T.
  const Tensor xg = x.clone().requires_grad_();
  strobe::ops::fp8_linear(xg, w).sum().backward();
  EXPECT_TRUE(xg.grad().defined());
  auto [y, x_t, sx, w_t, sw] = fwd(x, w, false, true);
  EXPECT_EQ(x_t.numel(), 0) << "x^T kept without a weight gradient";
  EXPECT_EQ(w_t.sizes(), (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(w_t.scalar_type(), torch::kFloat8_e4m3fn);
  std::tie(y, x_t, sx, w_t, sw) = fwd(x, w, true, false);
  EXPECT_EQ(x_t.sizes(), (std::vector<int64_t>{32, 16})) << "10 tokens padded to 16";
  EXPECT_TRUE(torch::equal(x_t.narrow(1, 10, 6).to(torch::kFloat), torch::zeros({32, 6})));
  EXPECT_EQ(w_t.numel(), 0);

  // NaN in x: every output NaN (the scale is NaN); Inf: none finite (the scale is infinite).
  Tensor bad = x.clone();
  bad[2][3] = NAN;
  EXPECT_TRUE(torch::isnan(strobe::ops::fp8_linear(bad, w)).all().item<bool>());
  bad = x.clone();
  bad[4][1] = INFINITY;
  EXPECT_FALSE(torch::isfinite(strobe::ops::fp8_linear(bad, w)).any().item<bool>());
  // Zeros: y is the bias exactly; a zero output gradient gives zero gradients.
  const Tensor b = torch::randn({16});
  const Tensor xz = torch::zeros({3, 32}).requires_grad_(), wz = w.clone().requires_grad_();
  const Tensor yz = strobe::ops::fp8_linear(xz, wz, b);
  EXPECT_TRUE(torch::equal(yz, b.expand({3, 16})));
  yz.backward(torch::zeros({3, 16}));
  EXPECT_TRUE(torch::equal(xz.grad(), torch::zeros({3, 32})));
  EXPECT_TRUE(torch::equal(wz.grad(), torch::zeros({16, 32})));
  // An empty batch.
  const Tensor xe = torch::zeros({0, 32}).requires_grad_(), we = w.clone().requires_grad_();
  const Tensor ye = strobe::ops::fp8_linear(xe, we);
  EXPECT_EQ(ye.sizes(), (std::vector<int64_t>{0, 16}));
  ye.sum().backward();
  EXPECT_TRUE(torch::equal(we.grad(), torch::zeros({16, 32})));
  // Meta: shapes and dtypes only.
  const Tensor ym = strobe::ops::fp8_linear(torch::empty({2, 7, 32}, torch::TensorOptions(torch::kMeta).dtype(torch::kBFloat16)),
                                            torch::empty({16, 32}, torch::TensorOptions(torch::kMeta).dtype(torch::kBFloat16)));
  EXPECT_EQ(ym.sizes(), (std::vector<int64_t>{2, 7, 16}));
  EXPECT_EQ(ym.scalar_type(), torch::kBFloat16);
}

// fp8_linear_swiglu is fp8_linear then swiglu, bit for bit, forward and backward: the amax of the
// output (y_amax, for the linear that reads it) and of d gate_up come from swiglu's kernels instead of
// a pass of their own, and are the same numbers. x_amax given to fp8_linear changes nothing either.
TEST(Fp8Linear, TheSwigluFusionAndAGivenAmaxGiveTheUnfusedBits) {
  torch::manual_seed(8);
  for (const auto dt : {torch::kFloat, torch::kBFloat16}) {
    const Tensor x0 = torch::randn({2, 9, 32}).to(dt), w0 = (torch::randn({64, 32}) * 0.2).to(dt);
    const Tensor wd0 = (torch::randn({16, 32}) * 0.2).to(dt), g = torch::randn({2, 9, 16}).to(dt);
    const Tensor xa = x0.clone().requires_grad_(), wa = w0.clone().requires_grad_(), wda = wd0.clone().requires_grad_();
    const Tensor ha = strobe::ops::swiglu(strobe::ops::fp8_linear(xa, wa));
    const Tensor ya = strobe::ops::fp8_linear(ha, wda);
    ya.backward(g);
    const Tensor xb = x0.clone().requires_grad_(), wb = w0.clone().requires_grad_(), wdb = wd0.clone().requires_grad_();
    const auto [hb, hb_amax] = strobe::ops::fp8_linear_swiglu(xb, wb);
    const Tensor yb = strobe::ops::fp8_linear(hb, wdb, std::nullopt, hb_amax);
    yb.backward(g);
    EXPECT_TRUE(torch::equal(ha, hb)) << dt;
    EXPECT_TRUE(torch::equal(hb_amax, ha.to(torch::kFloat).abs().amax())) << dt;
    EXPECT_FALSE(hb_amax.requires_grad());
    EXPECT_TRUE(torch::equal(ya, yb)) << dt;
    EXPECT_TRUE(torch::equal(xa.grad(), xb.grad())) << dt;
    EXPECT_TRUE(torch::equal(wa.grad(), wb.grad())) << dt;
    EXPECT_TRUE(torch::equal(wda.grad(), wdb.grad())) << dt;
    EXPECT_GT(xb.grad().abs().sum().item<double>(), 0.0);
  }
  // A NaN in the output gradient reaches d x and d weight through the amax swiglu's backward finds.
  const Tensor x = torch::randn({5, 32}).requires_grad_(), w = torch::randn({64, 32}).requires_grad_();
  Tensor g = torch::randn({5, 32});
  g[1][2] = NAN;
  std::get<0>(strobe::ops::fp8_linear_swiglu(x, w)).backward(g);
  EXPECT_TRUE(torch::isnan(x.grad()).all().item<bool>());
  EXPECT_TRUE(torch::isnan(w.grad()).all().item<bool>());
  // Meta shapes; a weight that cannot hold gate and up.
  const auto meta = torch::TensorOptions(torch::kMeta).dtype(torch::kBFloat16);
  const auto [ym, am] = strobe::ops::fp8_linear_swiglu(torch::empty({3, 32}, meta), torch::empty({96, 32}, meta));
  EXPECT_EQ(ym.sizes(), (std::vector<int64_t>{3, 48}));
  EXPECT_EQ(am.scalar_type(), torch::kFloat);
  strobe::testing::expect_error([&] { strobe::ops::fp8_linear_swiglu(x.detach(), torch::randn({48, 32})); },
                                "weight must hold gate and up (2 x F rows, F a multiple of 16), got [48, 32]");
}

TEST(Fp8Linear, BadArgumentsAreOneClearError) {
  using strobe::testing::expect_error;
  const Tensor x = torch::randn({4, 32});
  expect_error([&] { strobe::ops::fp8_linear(x, torch::randn({16, 24})); },
               "x must be [..., in_features] and weight [out_features, in_features], got [4, 32] and [16, 24]");
  expect_error([&] { strobe::ops::fp8_linear(torch::randn({4, 24}), torch::randn({16, 24})); },
               "out_features and in_features must be multiples of 16 (the float8 GEMM's rule), got weight [16, 24]");
  expect_error([&] { strobe::ops::fp8_linear(x, torch::randn({20, 32})); }, "multiples of 16");
  expect_error([&] { strobe::ops::fp8_linear(x.to(torch::kDouble), torch::randn({16, 32}, torch::kDouble)); },
               "x and weight must be float32, bfloat16 or float16, got Double and Double");
  expect_error([&] { strobe::ops::fp8_linear(x, torch::randn({16, 32}), torch::randn({15})); },
               "bias must be [out_features] (16)");
}

}  // namespace
