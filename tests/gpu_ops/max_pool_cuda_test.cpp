// strobe::max_pool2d's CUDA kernels against the op's CPU implementation in float64 (inputs rounded to
// the kernel's dtype first, so both sides see the same values; the caching allocator poisoned with
// NaN so an unwritten element fails; NaN never passes): output and index exactly, grad_x by relative
// error, for channels-last (vectorized and scalar: odd C, misaligned data) and NCHW, fp32/bf16/fp16,
// ResNet's stem window and the face detector's 2x2; NaN; bitwise repeatability; a small case for
// compute-sanitizer.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include "strobe/ops/ops.h"
#include "tests/gpu_test_util.h"

namespace {

using torch::Tensor;

using strobe::testing::kCuda;
using strobe::testing::poison_allocator;
using strobe::testing::rel_err;

struct Pool {
  std::vector<int64_t> kernel, stride, padding;
};
const Pool kStem{{3}, {2}, {1}}, kTwo{{2}, {2}, {0}};

std::tuple<Tensor, Tensor> fwd_op(const Tensor& x, const Pool& p) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::max_pool2d_fwd", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, at::IntArrayRef, at::IntArrayRef,
                                                               at::IntArrayRef)>();
  return op.call(x, p.kernel, p.stride, p.padding);
}

struct Run {
  Tensor y, index, gx;
};

// x and gy already in their layout and dtype on their device.
Run run(const Tensor& x, const Tensor& gy, const Pool& p) {
  Tensor xx = x.detach().requires_grad_();
  Run r;
  r.y = strobe::ops::max_pool2d(xx, p.kernel, p.stride, p.padding);
  r.index = std::get<1>(fwd_op(x.detach(), p));
  r.gx = torch::autograd::grad({r.y}, {xx}, {gy})[0];
  return r;
}

at::MemoryFormat fmt(bool cl) { return cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous; }

void check(const std::vector<int64_t>& shape, const Pool& p, torch::ScalarType dt, bool cl, bool with_nan = false) {
  poison_allocator();
  const auto dopt = torch::TensorOptions().dtype(torch::kDouble);
  Tensor x = torch::randn(shape, dopt).to(dt).to(torch::kDouble);
  if (dt != torch::kFloat) x.index_put_({torch::indexing::Slice(), torch::indexing::Slice(), 0}, 0.5);  // ties
  if (with_nan) {
    x.view({-1})[7] = NAN;
    x.view({-1})[x.numel() / 2] = NAN;
    x.view({-1})[x.numel() / 2 + 1] = NAN;
  }
  x = x.contiguous(fmt(cl));
  Tensor want_y = strobe::ops::max_pool2d(x, p.kernel, p.stride, p.padding);
  Tensor gy = torch::randn(want_y.sizes(), dopt).to(dt).to(torch::kDouble);
  const Run want = run(x, gy, p);
  const Run got = run(x.to(kCuda, dt).contiguous(fmt(cl)), gy.to(kCuda, dt), p);
  const std::string what = std::string(c10::toString(dt)) + " " + c10::str(at::IntArrayRef(shape)) + " kernel " +
                           c10::str(at::IntArrayRef(p.kernel)) + (cl ? " NHWC" : " NCHW") + (with_nan ? " NaN" : "");
  ASSERT_EQ(got.y.sizes(), want.y.sizes()) << what;
  EXPECT_EQ(got.y.scalar_type(), dt) << what;
  EXPECT_EQ(got.y.is_contiguous(fmt(cl)), true) << what;
  EXPECT_EQ(got.gx.is_contiguous(fmt(cl)), true) << what;
  const Tensor gyd = got.y.to(torch::kCPU, torch::kDouble);
  EXPECT_TRUE(gyd.isnan().equal(want.y.isnan())) << "NaN positions " << what;
  EXPECT_TRUE(torch::equal(gyd.nan_to_num(0), want.y.nan_to_num(0))) << "y " << what;
  EXPECT_TRUE(torch::equal(got.index.cpu(), want.index)) << "index " << what;
  const double tol = dt == torch::kFloat ? 1e-6 : dt == torch::kHalf ? 1e-3 : 8e-3;
  EXPECT_LT(rel_err(got.gx, want.gx), tol) << "grad_x " << what;
}

TEST(MaxPoolCuda, MatchesTheFloat64ReferenceForEveryDtypeLayoutAndShape) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(0);
  for (auto dt : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (const bool cl : {true, false}) {
      check({2, 64, 112, 112}, kStem, dt, cl);  // ResNet-50's stem (batch 2 of 128)
      check({2, 64, 64, 64}, kTwo, dt, cl);     // the face detector's stage 3 (batch 2 of 1024)
      check({2, 256, 32, 32}, kTwo, dt, cl);    // stage 4
      check({3, 3, 13, 11}, kStem, dt, cl);     // odd C: scalar channels-last path
      check({2, 12, 9, 7}, kTwo, dt, cl);       // C % 8 != 0 (bf16/fp16 scalar, fp32 vectorized)
      check({2, 16, 10, 9}, Pool{{3}, {1}, {1}}, dt, cl);          // stride 1: 9 windows per element
      check({1, 8, 11, 12}, Pool{{2, 3}, {1, 2}, {1, 1}}, dt, cl);  // rectangular
    }
  }
}

TEST(MaxPoolCuda, NaNPropagatesAsTheReference) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(1);
  for (auto dt : {torch::kFloat, torch::kBFloat16}) {
    for (const bool cl : {true, false}) {
      check({2, 16, 9, 9}, kStem, dt, cl, /*with_nan=*/true);
      check({2, 16, 8, 8}, kTwo, dt, cl, /*with_nan=*/true);
    }
  }
}

TEST(MaxPoolCuda, MisalignedChannelsLastDataTakesTheScalarPath) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(2);
  const std::vector<int64_t> shape{2, 16, 9, 8};
  const int64_t numel = 2 * 16 * 9 * 8;
  Tensor buf = torch::randn({numel + 1}, torch::TensorOptions(kCuda).dtype(torch::kBFloat16));
  // channels-last strides, data 2 bytes past a 16-byte boundary
  Tensor x = buf.as_strided(shape, {16 * 9 * 8, 1, 8 * 16, 16}, 1);
  ASSERT_TRUE(x.is_contiguous(at::MemoryFormat::ChannelsLast));
  Tensor xx = x.detach().requires_grad_();
  Tensor y = strobe::ops::max_pool2d(xx, {3}, {2}, {1});
  Tensor gy = torch::randn(y.sizes(), y.options());
  Tensor gx = torch::autograd::grad({y}, {xx}, {gy})[0];
  Tensor xd = x.to(torch::kCPU, torch::kDouble).requires_grad_();
  Tensor yd = strobe::ops::max_pool2d(xd, {3}, {2}, {1});
  Tensor gxd = torch::autograd::grad({yd}, {xd}, {gy.to(torch::kCPU, torch::kDouble)})[0];
  EXPECT_TRUE(torch::equal(y.to(torch::kCPU, torch::kDouble), yd));
  EXPECT_LT(rel_err(gx, gxd), 8e-3);
}

TEST(MaxPoolCuda, MatchesAtenOnTheModelsShapes) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(3);
  struct Shape {
    std::vector<int64_t> shape;
    Pool pool;
    bool cl;
  };
  for (const Shape& s : {Shape{{16, 64, 112, 112}, kStem, true}, Shape{{32, 64, 64, 64}, kTwo, false},
                         Shape{{32, 256, 32, 32}, kTwo, false}}) {
    Tensor x = torch::randn(s.shape, torch::TensorOptions(kCuda).dtype(torch::kBFloat16)).contiguous(fmt(s.cl));
    Tensor xa = x.detach().clone().requires_grad_(), xs = x.detach().clone().requires_grad_();
    Tensor want = torch::max_pool2d(xa, s.pool.kernel, s.pool.stride, s.pool.padding);
    Tensor got = strobe::ops::max_pool2d(xs, s.pool.kernel, s.pool.stride, s.pool.padding);
    EXPECT_TRUE(torch::equal(got, want)) << c10::str(at::IntArrayRef(s.shape));
    Tensor gy = torch::randn(want.sizes(), want.options());
    want.backward(gy), got.backward(gy);
    // fp32 sums of at most 4 bf16 gradients, rounded once: within ATen's rounding
    EXPECT_LT(rel_err(xs.grad(), xa.grad()), 4e-3) << c10::str(at::IntArrayRef(s.shape));
  }
}

TEST(MaxPoolCuda, BackwardIsBitwiseRepeatable) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(4);
  for (const bool cl : {true, false}) {
    Tensor x = torch::randn({8, 64, 56, 56}, torch::TensorOptions(kCuda).dtype(torch::kBFloat16)).contiguous(fmt(cl));
    Tensor gy;
    Tensor first;
    for (int rep = 0; rep < 3; ++rep) {
      Tensor xx = x.detach().requires_grad_();
      Tensor y = strobe::ops::max_pool2d(xx, {3}, {1}, {1});  // every element in 9 windows: sums of many terms
      if (!gy.defined()) gy = torch::randn(y.sizes(), y.options());
      Tensor gx = torch::autograd::grad({y}, {xx}, {gy})[0];
      if (rep == 0) {
        first = gx;
      } else {
        EXPECT_TRUE(torch::equal(gx, first)) << (cl ? "NHWC" : "NCHW") << " repetition " << rep;
      }
    }
  }
}

TEST(MaxPoolCuda, FloatDoubleIsAClearError) {
  SKIP_WITHOUT_CUDA();
  Tensor x = torch::randn({1, 2, 4, 4}, torch::TensorOptions(kCuda).dtype(torch::kDouble));
  try {
    strobe::ops::max_pool2d(x, {2});
    ADD_FAILURE() << "float64 accepted on CUDA";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("x must be float32, bfloat16 or float16"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(strobe::ops::max_pool2d_cuda_eligible(x));
  EXPECT_TRUE(strobe::ops::max_pool2d_cuda_eligible(x.to(torch::kBFloat16)));
}

// Small enough for compute-sanitizer memcheck: every kernel (NHWC vectorized and scalar, NCHW) once.
TEST(MaxPoolCuda, SmallCasesForSanitizer) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(5);
  check({2, 16, 7, 7}, kStem, torch::kBFloat16, true);
  check({2, 8, 7, 7}, kStem, torch::kFloat, true);
  check({2, 3, 7, 6}, kStem, torch::kHalf, true);
  check({2, 3, 9, 8}, kTwo, torch::kBFloat16, false);
}

}  // namespace
