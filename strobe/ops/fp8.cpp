// fp8_quantize: a tensor's float8 copy (and its transpose) with tensorwise dynamic scaling, the input
// of a scaled GEMM (docs/OPS.md). Argument checks shared by every device, the CPU implementation (ATen
// ops: the reference the CUDA kernels match bit for bit), the Meta kernel and the C++ wrapper. CUDA
// kernels: cuda/fp8_kernels.cu, glue fp8_cuda.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "strobe/ops/ops.h"

namespace strobe::ops {
namespace detail {

// Used by the CUDA glue too.
void fp8_check_input(const at::Tensor& x, at::ScalarType dtype) {
  TORCH_CHECK(x.defined() && x.dim() == 2, "fp8_quantize: x must be 2-D [rows, cols], got ", x.defined() ? x.dim() : 0,
              " dimensions");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "fp8_quantize: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "fp8_quantize: dtype must be Float8_e4m3fn or Float8_e5m2, got ", dtype);
}

double fp8_max(at::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn ? 448.0 : 57344.0; }

}  // namespace detail

namespace {

using at::Tensor;

constexpr double kFp8MinAmax = 1e-12;

std::tuple<Tensor, Tensor, Tensor> fp8q_cpu(const Tensor& x, at::ScalarType dtype, bool transpose) {
  detail::fp8_check_input(x, dtype);
  const double max = detail::fp8_max(dtype);
  const Tensor xf = x.to(at::kFloat);
  // max |x|, NaN when any element is NaN (amax propagates it; clamp_min keeps it).
  const Tensor amax = x.numel() == 0 ? at::zeros({}, xf.options()) : xf.abs().amax();
  const Tensor scale = at::full({}, max, xf.options()) / amax.clamp_min(kFp8MinAmax);
  const Tensor q = (xf * scale).clamp(-max, max).to(dtype);
  const Tensor q_t = transpose ? q.t().contiguous() : at::empty({0}, q.options());
  return {q, q_t, at::reciprocal(scale)};
}

std::tuple<Tensor, Tensor, Tensor> fp8q_meta(const Tensor& x, at::ScalarType dtype, bool transpose) {
  detail::fp8_check_input(x, dtype);
  const auto opts = x.options().dtype(dtype);
  Tensor q = at::empty_symint(x.sym_sizes(), opts);
  Tensor q_t = transpose ? at::empty_symint({x.sym_size(1), x.sym_size(0)}, opts) : at::empty({0}, opts);
  return {q, q_t, at::empty({}, x.options().dtype(at::kFloat))};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> fp8_quantize(const torch::Tensor& x, at::ScalarType dtype,
                                                                     bool transpose) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::fp8_quantize", "")
                             .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, at::ScalarType, bool)>();
  return op.call(x, dtype, transpose);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CPU, m) { m.impl("fp8_quantize", &strobe::ops::fp8q_cpu); }
TORCH_LIBRARY_IMPL(strobe, Meta, m) { m.impl("fp8_quantize", &strobe::ops::fp8q_meta); }
