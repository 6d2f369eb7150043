// fp8_linear on the GPU (cuBLASLt's float8 GEMMs) against a float64 reference of the same quantized
// math: the float8 operands are fp8_quantize's, whose CUDA bytes equal the CPU's (fp8_cuda_test.cpp),
// so the reference is the CPU's dequantized copies multiplied in float64. The outputs land in memory
// filled with NaN first. Shapes: a Llama-3.2-1B projection at 2 x 1024 tokens and a packed batch whose
// token count is not a multiple of 16; bf16 with a bias in the epilogue, fp32 with one added after;
// NaN reaching every output; a captured CUDA graph replayed on new values (no host read).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/cuda_graph.h"
#include "strobe/ops/ops.h"
#include "tests/gpu_test_util.h"

namespace {

using torch::Tensor;
using strobe::testing::kCuda;
using strobe::testing::fp8_dequantized;
using strobe::testing::rel_err;

struct Fp8LinearCase {
  std::vector<int64_t> x_shape;
  int64_t n;
  torch::ScalarType dtype;
  bool bias;
  double bound;
};

TEST(Fp8LinearCuda, EqualsTheFloat64ReferenceOfTheQuantizedMathForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  const std::vector<Fp8LinearCase> cases = {
      {{2, 1024, 2048}, 512, torch::kBFloat16, false, 6e-3},  // k_proj of Llama-3.2-1B
      {{2, 1024, 2048}, 2048, torch::kBFloat16, true, 6e-3},
      {{1000, 256}, 384, torch::kBFloat16, true, 6e-3},  // 1000 tokens: d weight's reduction padded to 1008
      // fp32 out: Hopper's float8 MMA accumulates in fewer than fp32's bits between cuBLASLt's fp32
      // promotions (measured 1.04e-4 on an H200), so the bound is the accumulator's, not the output's.
      {{1000, 256}, 384, torch::kFloat, true, 4e-4},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.dtype << " x " << torch::IntArrayRef(c.x_shape) << " N " << c.n);
    torch::manual_seed(c.n);
    const int64_t k = c.x_shape.back();
    const Tensor x = torch::randn(c.x_shape, kCuda).to(c.dtype).requires_grad_();
    const Tensor w = (torch::randn({c.n, k}, kCuda) * 0.02).to(c.dtype).requires_grad_();
    const Tensor b = torch::randn({c.n}, kCuda).to(c.dtype).requires_grad_();
    strobe::testing::poison_allocator();
    const Tensor y = strobe::ops::fp8_linear(x, w, c.bias ? std::optional<Tensor>(b) : std::nullopt);
    ASSERT_TRUE(y.is_cuda());
    ASSERT_EQ(y.scalar_type(), c.dtype);
    const Tensor xd = fp8_dequantized(x.detach(), torch::kFloat8_e4m3fn), wd = fp8_dequantized(w.detach(), torch::kFloat8_e4m3fn);
    Tensor y_ref = torch::matmul(xd, wd.t());
    if (c.bias) y_ref = y_ref + b.detach().cpu().to(torch::kDouble);
    EXPECT_LT(rel_err(y.cpu(), y_ref), c.bound);

    const Tensor g = torch::randn(y.sizes(), kCuda).to(c.dtype);
    strobe::testing::poison_allocator();
    y.backward(g);
    const Tensor gd = fp8_dequantized(g, torch::kFloat8_e5m2);
    EXPECT_LT(rel_err(x.grad().cpu(), torch::matmul(gd, wd)), c.bound) << "d x";
    EXPECT_LT(rel_err(w.grad().cpu(), torch::matmul(gd.reshape({-1, c.n}).t(), xd.reshape({-1, k}))), c.bound)
        << "d weight";
    if (c.bias) EXPECT_LT(rel_err(b.grad().cpu(), g.cpu().to(torch::kDouble).reshape({-1, c.n}).sum(0)), c.bound);
  }
}

TEST(Fp8LinearCuda, NanReachesEveryOutputAndAGraphReplaysNewValues) {
  SKIP_WITHOUT_CUDA();
  Tensor x = torch::randn({64, 256}, kCuda).to(torch::kBFloat16);
  const Tensor w = (torch::randn({128, 256}, kCuda) * 0.05).to(torch::kBFloat16);
  Tensor bad = x.clone();
  bad[5][7] = NAN;
  EXPECT_TRUE(torch::isnan(strobe::ops::fp8_linear(bad, w)).all().item<bool>());

  Tensor y;
  strobe::ops::fp8_linear(x, w);  // warm-up outside the capture (cuBLASLt's workspace)
  strobe::ops::CudaGraph graph;
  graph.capture(kCuda, [&] { y = strobe::ops::fp8_linear(x, w); });
  for (int i = 0; i < 3; ++i) {
    x.copy_(torch::randn({64, 256}, kCuda) * (i + 1));
    graph.replay();
    const Tensor eager = strobe::ops::fp8_linear(x, w);
    EXPECT_TRUE(torch::equal(y, eager)) << "replay " << i << " differs from an eager call on the same values";
  }
}

}  // namespace
