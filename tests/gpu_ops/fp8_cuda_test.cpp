// fp8_quantize's CUDA kernels against the CPU implementation (itself held to a float64 reference of
// the same math in tests/ops/fp8_test.cpp): the same bytes of q and q_t and the same scale, NaN's
// sign aside, for fp32, bf16 and fp16 inputs into e4m3 and e5m2, with the memory the outputs land in
// filled with NaN bytes first so an element never written fails. Shapes: one element, odd sizes (the
// tiles' edges, both kernel versions), a llama activation [16384, 2048] and a weight [8192, 2048]; a strided input; NaN, Inf,
// zeros, an empty tensor; captured in a CUDA graph and replayed on new values (no host read). Each case
// also through fp8_quantize_sum (the same bytes, and x's column sums against float64).
#include <ATen/core/dispatch/Dispatcher.h>
#include <cmath>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/cuda_graph.h"
#include "strobe/ops/ops.h"
#include "tests/gpu_test_util.h"

namespace {

using torch::Tensor;
using strobe::testing::kCuda;

// The caching allocator's next blocks hold 0x7f bytes: NaN in both float8 formats.
void poison_bytes(int64_t bytes = 512 << 20) {
  Tensor junk = torch::full({bytes}, 0x7f, torch::TensorOptions(kCuda).dtype(torch::kByte));
  junk.reset();
}

// q (float8, any device) equal to want's bytes, NaN for NaN (either sign).
void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  const Tensor g = got.cpu(), w = want.cpu();
  ASSERT_EQ(g.sizes(), w.sizes()) << what;
  const Tensor gn = torch::isnan(g.to(torch::kFloat)), wn = torch::isnan(w.to(torch::kFloat));
  EXPECT_TRUE(torch::equal(gn, wn)) << what << ": NaN in different places (" << gn.sum().item<int64_t>() << " vs "
                                    << wn.sum().item<int64_t>() << ")";
  const Tensor differ = (g.view(torch::kByte) != w.view(torch::kByte)).logical_and(wn.logical_not());
  EXPECT_EQ(differ.sum().item<int64_t>(), 0) << what << ": bytes that differ from the CPU's";
}

// The internal op fp8_quantize_sum: fp8_quantize and the fp32 sums of x's columns (a float8 linear's bias
// gradient, from the cast's read of x).
std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_sum(const Tensor& x, torch::ScalarType format, bool transpose) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::fp8_quantize_sum", "")
                             .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, at::ScalarType, bool,
                                                                               const std::optional<Tensor>&)>();
  return op.call(x, format, transpose, std::nullopt);
}

// Column sums against a float64 sum of the same inputs: NaN and Inf where the reference has them,
// finite ones within 1e-5 relative (fp32 accumulation), zero sums exactly zero.
void expect_sums(const Tensor& sums, const Tensor& x, const std::string& what) {
  ASSERT_TRUE(sums.is_cuda() && sums.scalar_type() == torch::kFloat) << what;
  const Tensor got = sums.cpu().to(torch::kDouble), ref = x.cpu().to(torch::kDouble).sum(0);
  ASSERT_EQ(got.sizes(), ref.sizes()) << what;
  EXPECT_TRUE(torch::equal(torch::isnan(got), torch::isnan(ref))) << what << ": NaN sums in different columns";
  const Tensor inf = torch::isinf(ref);
  EXPECT_TRUE(torch::equal(got.masked_select(inf), ref.masked_select(inf))) << what << ": Inf sums";
  const Tensor fin = torch::isfinite(ref);
  const Tensor g = got.masked_select(fin), r = ref.masked_select(fin);
  const double den = r.pow(2).sum().item<double>();
  if (den == 0) EXPECT_EQ(g.abs().max().item<double>(), 0) << what << ": zero sums";
  else EXPECT_LT(std::sqrt((g - r).pow(2).sum().item<double>() / den), 1e-5) << what << ": column sums";
}

void check_against_cpu(const Tensor& x, torch::ScalarType format, const std::string& what) {
  const auto [cq, cqt, cs] = strobe::ops::fp8_quantize(x.cpu(), format, true);
  for (bool transpose : {true, false}) {
    for (bool sums : {false, true}) {
      const std::string w = what + (transpose ? "" : " without q_t") + (sums ? " with sums" : "");
      poison_bytes();
      Tensor q, q_t, s, col_sums;
      if (sums) std::tie(q, q_t, s, col_sums) = quantize_sum(x, format, transpose);
      else std::tie(q, q_t, s) = strobe::ops::fp8_quantize(x, format, transpose);
      ASSERT_TRUE(q.is_cuda() && s.is_cuda());
      expect_same(q, cq, w + " q");
      if (transpose) expect_same(q_t, cqt, w + " q_t");
      else EXPECT_EQ(q_t.numel(), 0) << w;
      const float a = s.item<float>(), b = cs.item<float>();
      EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << w << ": scale_inv " << a << " vs the CPU's " << b;
      if (sums) expect_sums(col_sums, x, w);
    }
  }
}

TEST(Fp8QuantizeCuda, TheCpuImplementationsBytesForEveryInputAndShape) {
  SKIP_WITHOUT_CUDA();
  // v1 (one element a thread) for {1, 1}, {67, 129}, {33, 31} and {200, 136} with q_t; v3 (8 elements a
  // thread, 64 x 64 tiles) for the rest, {208, 136} and {200, 136} without q_t at partial tiles' edges.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},     {67, 129},    {33, 31},    {208, 136},
                                                           {200, 136}, {16384, 2048}, {8192, 2048}};
  for (const auto dtype : {torch::kBFloat16, torch::kFloat, torch::kHalf}) {
    for (const auto format : {torch::kFloat8_e4m3fn, torch::kFloat8_e5m2}) {
      for (const auto& [rows, cols] : shapes) {
        if (rows * cols > (1 << 20) && dtype != torch::kBFloat16) continue;  // the large ones in bf16 only
        torch::manual_seed(rows + cols);
        const Tensor mag = torch::pow(10.0, torch::rand({rows, cols}, kCuda) * 10 - 7);
        const Tensor x = (mag * torch::randn({rows, cols}, kCuda).sign()).to(dtype);
        check_against_cpu(x, format, std::to_string(rows) + "x" + std::to_string(cols) + " " + c10::toString(dtype) +
                                         " -> " + c10::toString(format));
      }
    }
  }
}

TEST(Fp8QuantizeCuda, StridedNanInfZerosAndEmptyAsOnTheCpu) {
  SKIP_WITHOUT_CUDA();
  for (const auto format : {torch::kFloat8_e4m3fn, torch::kFloat8_e5m2}) {
    check_against_cpu(torch::randn({96, 40}, kCuda).to(torch::kBFloat16).t(), format, "strided");
    Tensor x = torch::randn({70, 90}, kCuda);
    x[5][6] = NAN;
    check_against_cpu(x, format, "a NaN");
    x = torch::randn({70, 90}, kCuda);
    x[69][89] = -INFINITY;
    check_against_cpu(x, format, "an Inf");
    check_against_cpu(torch::zeros({64, 64}, kCuda), format, "zeros");
    check_against_cpu(torch::zeros({0, 7}, kCuda), format, "empty");
    check_against_cpu(torch::zeros({0, 64}, kCuda), format, "empty, 64 columns");
  }
}

TEST(Fp8QuantizeCuda, ACapturedGraphQuantizesEachReplaysValues) {
  SKIP_WITHOUT_CUDA();
  Tensor x = torch::randn({256, 512}, kCuda).to(torch::kBFloat16);
  Tensor q, q_t, s;
  strobe::ops::fp8_quantize(x, torch::kFloat8_e4m3fn, true);  // warm-up outside the capture
  strobe::ops::CudaGraph graph;
  graph.capture(kCuda, [&] { std::tie(q, q_t, s) = strobe::ops::fp8_quantize(x, torch::kFloat8_e4m3fn, true); });
  for (int i = 0; i < 3; ++i) {
    x.copy_(torch::randn({256, 512}, kCuda) * (i + 1) * 10);
    graph.replay();
    const auto [cq, cqt, cs] = strobe::ops::fp8_quantize(x.cpu(), torch::kFloat8_e4m3fn, true);
    expect_same(q, cq, "replay " + std::to_string(i) + " q");
    expect_same(q_t, cqt, "replay " + std::to_string(i) + " q_t");
    EXPECT_EQ(s.item<float>(), cs.item<float>()) << "replay " << i;
  }
}

}  // namespace
