// conv3x3_maxpool_relu on CPU: the op (its fwd/bwd kernels) against autograd through plain ATen
// conv2d / max_pool2d / relu in float64, uint8 scaling, the max-pool tie rule, Meta shapes and
// argument errors.
#include <cmath>

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/ops/op_test_util.h"

namespace {

using torch::Tensor;

using strobe::testing::rel_err;

struct Grads {
  Tensor y, gx, gw, gb;
};

Grads run(bool fused, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& gy) {
  Tensor xr = x.detach().clone().requires_grad_(true), wr = w.detach().clone().requires_grad_(true),
         br = b.detach().clone().requires_grad_(true);
  Tensor y = fused ? strobe::ops::conv3x3_maxpool_relu(xr, wr, br)
                   : strobe::ops::conv3x3_maxpool_relu_reference(xr, wr, br);
  y.backward(gy);
  return {y.detach(), xr.grad(), wr.grad(), br.grad()};
}

struct Shape {
  int64_t n, cin, cout, h, w;
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << s.n << "x" << s.cin << "to" << s.cout << "_" << s.h << "x" << s.w;
}

class ConvPoolCpu : public ::testing::TestWithParam<Shape> {};

TEST_P(ConvPoolCpu, MatchesAtenAutogradInDouble) {
  const Shape s = GetParam();
  torch::manual_seed(7 + s.h * 31 + s.w);
  const auto opt = torch::TensorOptions().dtype(torch::kDouble);
  const Tensor x = torch::randn({s.n, s.cin, s.h, s.w}, opt);
  const Tensor w = torch::randn({s.cout, s.cin, 3, 3}, opt) * 0.3;
  const Tensor b = torch::randn({s.cout}, opt) * 0.1;
  const Tensor gy = torch::randn({s.n, s.cout, s.h / 2, s.w / 2}, opt);
  const Grads got = run(true, x, w, b, gy), want = run(false, x, w, b, gy);
  EXPECT_EQ(got.y.sizes(), want.y.sizes());
  EXPECT_LT(rel_err(got.y, want.y), 1e-12);
  EXPECT_LT(rel_err(got.gx, want.gx), 1e-12);
  EXPECT_LT(rel_err(got.gw, want.gw), 1e-12);
  EXPECT_LT(rel_err(got.gb, want.gb), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ConvPoolCpu,
                         ::testing::Values(Shape{3, 1, 4, 18, 18}, Shape{2, 4, 16, 19, 17},
                                           Shape{2, 16, 8, 8, 10}, Shape{1, 3, 5, 2, 2}));

TEST(ConvPoolCpuOp, TiesGoToTheFirstMaximumLikeMaxPool) {
  // x = 0: every conv output is the bias, so every 2x2 window is a four-way tie.
  const auto opt = torch::TensorOptions().dtype(torch::kDouble);
  const Tensor x = torch::zeros({2, 1, 6, 6}, opt), w = torch::randn({4, 1, 3, 3}, opt);
  const Tensor b = torch::tensor({0.5, -0.5, 1.0, 0.25}, opt);
  const Tensor gy = torch::randn({2, 4, 3, 3}, opt);
  const Grads got = run(true, x, w, b, gy), want = run(false, x, w, b, gy);
  EXPECT_LT(rel_err(got.gx, want.gx), 1e-12);
  EXPECT_LT(rel_err(got.gw, want.gw), 1e-12);
  EXPECT_LT(rel_err(got.gb, want.gb), 1e-12);
  EXPECT_GT(got.gx.abs().sum().item<double>(), 0.0);
}

TEST(ConvPoolCpuOp, Uint8InputIsScaled) {
  torch::manual_seed(3);
  const Tensor x = torch::randint(0, 256, {2, 1, 10, 12}, torch::kUInt8);
  const Tensor w = torch::randn({4, 1, 3, 3}), b = torch::randn({4}) * 0.1;
  const Tensor y = strobe::ops::conv3x3_maxpool_relu(x, w, b, 1.0 / 255.0);
  EXPECT_EQ(y.scalar_type(), torch::kFloat);
  const Tensor want =
      strobe::ops::conv3x3_maxpool_relu_reference(x.to(torch::kDouble) / 255.0, w.to(torch::kDouble),
                                                  b.to(torch::kDouble));
  EXPECT_LT(rel_err(y, want), 1e-6);
  const Tensor yb = strobe::ops::conv3x3_maxpool_relu(x, w, b, 1.0 / 255.0, torch::kBFloat16);
  EXPECT_EQ(yb.scalar_type(), torch::kBFloat16);
  EXPECT_LT(rel_err(yb, want), 1e-2);
}

TEST(ConvPoolCpuOp, MetaShapesAndBadArguments) {
  const auto meta = torch::TensorOptions().device(torch::kMeta);
  const Tensor y = strobe::ops::conv3x3_maxpool_relu(torch::empty({5, 4, 19, 8}, meta),
                                                     torch::empty({16, 4, 3, 3}, meta),
                                                     torch::empty({16}, meta), 1.0, torch::kBFloat16);
  EXPECT_EQ(y.sizes(), (torch::IntArrayRef{5, 16, 9, 4}));
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  const Tensor x = torch::randn({1, 4, 8, 8});
  EXPECT_THROW(strobe::ops::conv3x3_maxpool_relu(x, torch::randn({16, 3, 3, 3}), torch::randn({16})),
               c10::Error);
  EXPECT_THROW(strobe::ops::conv3x3_maxpool_relu(x, torch::randn({16, 4, 5, 5}), torch::randn({16})),
               c10::Error);
  EXPECT_THROW(strobe::ops::conv3x3_maxpool_relu(x, torch::randn({16, 4, 3, 3}), torch::randn({8})),
               c10::Error);
  EXPECT_THROW(strobe::ops::conv3x3_maxpool_relu(torch::randn({4, 8, 8}), torch::randn({16, 4, 3, 3}),
                                                 torch::randn({16})),
               c10::Error);
}

}  // namespace
