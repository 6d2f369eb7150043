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

// fp8_linear_swiglu on the GPU: swiglu's kernels find the amax of their outputs (y forward, d gate_up
// backward) as they write them; the result is fp8_linear then swiglu bit for bit (whose casts make
// their own amax pass), and y_amax is max |y|. Shapes of both cast kernels: 2 x 1024 tokens (16-byte
// loads) and 1000 tokens (not a multiple of 16: element by element where a transpose is made);
// outputs over NaN-filled memory.
TEST(Fp8LinearCuda, TheSwigluFusionGivesTheUnfusedBits) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(3);
  struct Case {
    std::vector<int64_t> x_shape;
    int64_t f;
    torch::ScalarType dtype;
  };
  for (const Case& c : {Case{{2, 1024, 256}, 512, torch::kBFloat16}, Case{{1000, 128}, 48, torch::kBFloat16},
                        Case{{1000, 128}, 64, torch::kFloat}}) {
    SCOPED_TRACE(::testing::Message() << c.dtype << " x " << torch::IntArrayRef(c.x_shape) << " F " << c.f);
    const int64_t k = c.x_shape.back();
    const Tensor x0 = torch::randn(c.x_shape, kCuda).to(c.dtype), w0 = (torch::randn({2 * c.f, k}, kCuda) * 0.1).to(c.dtype);
    const Tensor wd0 = (torch::randn({k, c.f}, kCuda) * 0.1).to(c.dtype);
    std::vector<int64_t> out_shape = c.x_shape;
    out_shape.back() = k;
    const Tensor g = torch::randn(out_shape, kCuda).to(c.dtype);
    const Tensor xa = x0.clone().requires_grad_(), wa = w0.clone().requires_grad_(), wda = wd0.clone().requires_grad_();
    strobe::testing::poison_allocator();
    const Tensor ha = strobe::ops::swiglu(strobe::ops::fp8_linear(xa, wa));
    strobe::ops::fp8_linear(ha, wda).backward(g);
    const Tensor xb = x0.clone().requires_grad_(), wb = w0.clone().requires_grad_(), wdb = wd0.clone().requires_grad_();
    strobe::testing::poison_allocator();
    const auto [hb, hb_amax] = strobe::ops::fp8_linear_swiglu(xb, wb);
    strobe::ops::fp8_linear(hb, wdb, std::nullopt, hb_amax).backward(g);
    EXPECT_TRUE(torch::equal(ha, hb));
    EXPECT_EQ(hb_amax.item<float>(), ha.to(torch::kFloat).abs().max().item<float>());
    EXPECT_TRUE(torch::equal(xa.grad(), xb.grad()));
    EXPECT_TRUE(torch::equal(wa.grad(), wb.grad()));
    EXPECT_TRUE(torch::equal(wda.grad(), wdb.grad()));
    EXPECT_TRUE(torch::isfinite(xb.grad()).all().item<bool>());
  }
  // A NaN in the output gradient: swiglu's backward amax is NaN, so are d x and d weight.
  const Tensor x = torch::randn({64, 128}, kCuda).to(torch::kBFloat16).requires_grad_();
  const Tensor w = (torch::randn({96, 128}, kCuda) * 0.1).to(torch::kBFloat16).requires_grad_();
  Tensor g = torch::randn({64, 48}, kCuda).to(torch::kBFloat16);
  g[9][3] = NAN;
  std::get<0>(strobe::ops::fp8_linear_swiglu(x, w)).backward(g);
  EXPECT_TRUE(torch::isnan(x.grad()).all().item<bool>());
  EXPECT_TRUE(torch::isnan(w.grad()).all().item<bool>());
}

}  // namespace
