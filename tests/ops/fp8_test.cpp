// fp8_quantize on the CPU against a float64 reference of the same quantized math: amax and the scale
// in float64 rounded where the op rounds (the fp32 scale, the fp32 product x * scale: exact in float64,
// then rounded once), the float8 value by round-to-nearest-even on the format's grid with saturation.
// The CPU op must give exactly those values, and its dequantized copy must stay within half a step
// of the format's grid of x (relative 2^-4 for e4m3, 2^-3 for e5m2 above the normal range). Then the
// edges: NaN and Inf reach the scale, zeros and empty tensors, the transpose, bad arguments. The CUDA
// kernels are held to this implementation's bytes in tests/gpu_ops/fp8_cuda_test.cpp.
#include <cfenv>
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/ops/op_test_util.h"

namespace {

using torch::Tensor;

struct Format {
  torch::ScalarType dtype;
  int mantissa_bits;
  int min_exponent;  // of the smallest normal: 2^min_exponent
  double max;
};
const Format kE4M3{torch::kFloat8_e4m3fn, 3, -6, 448.0};
const Format kE5M2{torch::kFloat8_e5m2, 2, -14, 57344.0};

// v (an fp32 value) to the nearest value of the format's grid, ties to even, saturated at +-max.
double round_to_format(double v, const Format& f) {
  if (std::isnan(v)) return v;
  const double a = std::fabs(v);
  if (a >= f.max) return std::copysign(f.max, v);
  if (a == 0) return v;
  const int e = std::max(static_cast<int>(std::floor(std::log2(a))), f.min_exponent);
  const double step = std::ldexp(1.0, e - f.mantissa_bits);
  std::fesetround(FE_TONEAREST);
  const double r = std::nearbyint(v / step) * step;
  return std::fabs(r) > f.max ? std::copysign(f.max, v) : r;
}

struct Reference {
  double scale_inv;
  Tensor q;  // float64 values of the float8 copy
};

Reference reference(const Tensor& x, const Format& f) {
  const Tensor x64 = x.to(torch::kDouble).contiguous();
  const double amax = x.numel() == 0 ? 0.0 : x64.abs().max().item<double>();
  const float scale = static_cast<float>(f.max / std::max(amax, static_cast<double>(1e-12f)));
  Tensor q = torch::empty_like(x64);
  const double* in = x64.data_ptr<double>();
  double* out = q.data_ptr<double>();
  for (int64_t i = 0; i < x64.numel(); ++i) {
    const float product = static_cast<float>(in[i] * static_cast<double>(scale));  // exact, then one rounding
    out[i] = round_to_format(product, f);
  }
  return {static_cast<double>(1.0f / scale), q};
}

// Values over many binades, the smallest ones below the format's normal range once scaled.
Tensor spread(int64_t rows, int64_t cols, torch::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  const Tensor mag = torch::pow(10.0, torch::rand({rows, cols}, torch::kDouble) * 12 - 9);
  const Tensor sign = torch::where(torch::rand({rows, cols}) < 0.5, -1.0, 1.0).to(torch::kDouble);
  return (mag * sign).to(dtype);
}

class Fp8Quantize : public ::testing::TestWithParam<std::tuple<torch::ScalarType, int>> {};

TEST_P(Fp8Quantize, GivesTheFloat64ReferencesValuesAndStaysWithinHalfAStep) {
  const auto [dtype, which] = GetParam();
  const Format& f = which == 0 ? kE4M3 : kE5M2;
  for (const auto& shape : std::vector<std::pair<int64_t, int64_t>>{{67, 129}, {1, 1}, {256, 64}}) {
    const Tensor x = spread(shape.first, shape.second, dtype, 7 + shape.first);
    const auto [q, q_t, scale_inv] = strobe::ops::fp8_quantize(x, f.dtype, /*transpose=*/true);
    ASSERT_EQ(q.scalar_type(), f.dtype);
    ASSERT_EQ(q.sizes(), x.sizes());
    ASSERT_EQ(q_t.sizes(), (std::vector<int64_t>{shape.second, shape.first}));
    ASSERT_EQ(scale_inv.scalar_type(), torch::kFloat);
    ASSERT_EQ(scale_inv.dim(), 0);
    const Reference ref = reference(x, f);
    EXPECT_EQ(scale_inv.item<double>(), ref.scale_inv);
    const Tensor got = q.to(torch::kDouble);
    EXPECT_TRUE(torch::equal(got, ref.q)) << "elements off the reference: " << (got != ref.q).sum().item<int64_t>()
                                          << " of " << got.numel();
    EXPECT_TRUE(torch::equal(q_t.view(torch::kByte), q.t().contiguous().view(torch::kByte))) << "q_t is not q transposed";
    // Against x itself: half a step of the grid (relative above the normal range, absolute below it).
    const double sinv = scale_inv.item<double>();
    const Tensor x64 = x.to(torch::kDouble), scaled = x64 / sinv;
    const Tensor normal = scaled.abs() >= std::ldexp(1.0, f.min_exponent);
    const Tensor err = (got * sinv - x64).abs();
    const double rel = std::ldexp(1.0, -(f.mantissa_bits + 1)) * 1.0001;
    const double subnormal = std::ldexp(1.0, f.min_exponent - f.mantissa_bits - 1) * sinv * 1.0001;
    EXPECT_TRUE(torch::where(normal, err <= rel * x64.abs(), err <= subnormal).all().item<bool>());
    EXPECT_GT(normal.logical_not().sum().item<int64_t>() + (shape.first == 1 ? 1 : 0), 0)
        << "the shape has no value below the normal range: the subnormal path is untested";
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesAndFormats, Fp8Quantize,
                         ::testing::Combine(::testing::Values(torch::kFloat, torch::kBFloat16, torch::kHalf),
                                            ::testing::Values(0, 1)));

TEST(Fp8QuantizeEdges, NanAndInfReachTheScaleZerosAndEmptyTensorsDoNot) {
  for (const Format& f : {kE4M3, kE5M2}) {
    Tensor x = torch::randn({9, 17});
    x[3][4] = NAN;
    auto [q, q_t, scale_inv] = strobe::ops::fp8_quantize(x, f.dtype, true);
    EXPECT_TRUE(std::isnan(scale_inv.item<float>()));
    EXPECT_TRUE(torch::isnan(q.to(torch::kFloat)).all().item<bool>()) << "a NaN amax makes every element NaN";

    x = torch::randn({9, 17});
    x[2][5] = INFINITY;
    std::tie(q, q_t, scale_inv) = strobe::ops::fp8_quantize(x, f.dtype, true);
    EXPECT_TRUE(std::isinf(scale_inv.item<float>()));
    const Tensor qf = q.to(torch::kFloat);
    EXPECT_TRUE(std::isnan(qf[2][5].item<float>()));
    EXPECT_EQ(torch::isnan(qf).sum().item<int64_t>(), 1) << "finite elements scaled by 0 are 0, not NaN";

    std::tie(q, q_t, scale_inv) = strobe::ops::fp8_quantize(torch::zeros({4, 6}, torch::kBFloat16), f.dtype, false);
    EXPECT_TRUE(torch::equal(q.to(torch::kFloat), torch::zeros({4, 6})));
    EXPECT_EQ(q_t.numel(), 0) << "no transpose asked";
    EXPECT_EQ(scale_inv.item<float>(), 1.0f / static_cast<float>(f.max / 1e-12f));

    std::tie(q, q_t, scale_inv) = strobe::ops::fp8_quantize(torch::zeros({0, 5}), f.dtype, true);
    EXPECT_EQ(q.sizes(), (std::vector<int64_t>{0, 5}));
    EXPECT_EQ(q_t.sizes(), (std::vector<int64_t>{5, 0}));
    EXPECT_TRUE(std::isfinite(scale_inv.item<float>()));
  }
  // A strided input quantizes as its values.
  const Tensor x = torch::randn({40, 24}).t();
  const auto [a, at, as] = strobe::ops::fp8_quantize(x, torch::kFloat8_e4m3fn, false);
  const auto [b, bt, bs] = strobe::ops::fp8_quantize(x.contiguous(), torch::kFloat8_e4m3fn, false);
  EXPECT_TRUE(torch::equal(a.view(torch::kByte), b.view(torch::kByte)));
}

TEST(Fp8QuantizeEdges, BadArgumentsAreOneClearError) {
  using strobe::testing::expect_error;
  expect_error([] { strobe::ops::fp8_quantize(torch::randn({2, 3, 4}), torch::kFloat8_e4m3fn); }, "x must be 2-D");
  expect_error([] { strobe::ops::fp8_quantize(torch::randn({2, 3}, torch::kDouble), torch::kFloat8_e4m3fn); },
               "x must be float32, bfloat16 or float16, got Double");
  expect_error([] { strobe::ops::fp8_quantize(torch::randn({2, 3}), torch::kBFloat16); },
               "dtype must be Float8_e4m3fn or Float8_e5m2, got BFloat16");
  expect_error([] { strobe::ops::fp8_quantize(torch::randn({2, 3}), torch::kFloat8_e4m3fn, false, torch::ones({1})); },
               "amax must be a 0-dim float32 tensor on x's device");
}

// A producer's amax replaces the pass over x: the true amax gives the same bytes and scale, and the
// scale is the given amax's (twice the amax: every element lands on the half-scale grid).
TEST(Fp8QuantizeEdges, AGivenAmaxIsTheOneUsed) {
  for (const Format& f : {kE4M3, kE5M2}) {
    const Tensor x = torch::randn({24, 40}, torch::kBFloat16);
    const auto [q, q_t, s] = strobe::ops::fp8_quantize(x, f.dtype, true);
    const Tensor amax = x.to(torch::kFloat).abs().amax();
    const auto [gq, gq_t, gs] = strobe::ops::fp8_quantize(x, f.dtype, true, amax);
    EXPECT_TRUE(torch::equal(q.view(torch::kByte), gq.view(torch::kByte)));
    EXPECT_TRUE(torch::equal(q_t.view(torch::kByte), gq_t.view(torch::kByte)));
    EXPECT_TRUE(torch::equal(s, gs));
    const auto [hq, hq_t, hs] = strobe::ops::fp8_quantize(x, f.dtype, false, amax * 2);
    EXPECT_FLOAT_EQ(hs.item<float>(), 2 * s.item<float>());
    EXPECT_FALSE(torch::equal(q.view(torch::kByte), hq.view(torch::kByte))) << "the given amax was not used";
    const Tensor nan_amax = torch::full({}, NAN);
    EXPECT_TRUE(torch::isnan(std::get<0>(strobe::ops::fp8_quantize(x, f.dtype, false, nan_amax)).to(torch::kFloat)).all().item<bool>())
        << "a producer's NaN amax reaches every element";
  }
}

}  // namespace
