// CUDA glue of fp8_quantize and fp8_quantize_sum (kernels in cuda/fp8_kernels.cu): a given amax is only read.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda/fp8.h"
#include "strobe/ops/cuda_glue.h"
#include "strobe/ops/internal.h"

namespace strobe::ops {
namespace {

// (q, q_t, scale_inv, the fp32 sums of x's columns when `sums`, else an empty [0] tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x, at::ScalarType dtype,
                                                                    bool transpose, const std::optional<at::Tensor>& given,
                                                                    bool sums) {
  detail::fp8_check_input(x, dtype, given);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dt = detail::kernel_dtype(x, "fp8_quantize (CUDA)", "x", detail::kFloatingTypes);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  const auto opts = x.options().dtype(dtype);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor q = at::empty({rows, cols}, opts);
  at::Tensor q_t = transpose ? at::empty({cols, rows}, opts) : at::empty({0}, opts);
  const bool amax_given = given && given->defined();
  at::Tensor amax = amax_given ? given->contiguous() : at::empty({}, f32);
  at::Tensor scale_inv = at::empty({}, f32);
  at::Tensor col_sums = sums ? at::empty({cols}, f32) : at::empty({0}, f32);
  const int64_t work = sums ? cuda::fp8_col_work_floats(xc.data_ptr(), rows, cols, transpose) : 0;
  at::Tensor col_work = at::empty({work}, f32);
  const auto format = dtype == at::kFloat8_e4m3fn ? cuda::Fp8Format::kE4M3 : cuda::Fp8Format::kE5M2;
  C10_CUDA_CHECK(cuda::fp8_quantize(xc.data_ptr(), rows, cols, dt, format, q.data_ptr(),
                                    transpose ? q_t.data_ptr() : nullptr, amax.data_ptr<float>(), amax_given,
                                    scale_inv.data_ptr<float>(), sums ? col_sums.data_ptr<float>() : nullptr,
                                    work > 0 ? col_work.data_ptr<float>() : nullptr, detail::current_stream()));
  return {q, q_t, scale_inv, col_sums};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8q_cuda(const at::Tensor& x, at::ScalarType dtype, bool transpose,
                                                         const std::optional<at::Tensor>& given) {
  auto [q, q_t, scale_inv, unused] = quantize(x, dtype, transpose, given, false);
  return {q, q_t, scale_inv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8qs_cuda(const at::Tensor& x, at::ScalarType dtype,
                                                                      bool transpose,
                                                                      const std::optional<at::Tensor>& given) {
  return quantize(x, dtype, transpose, given, true);
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("fp8_quantize", &strobe::ops::fp8q_cuda);
  m.impl("fp8_quantize_sum", &strobe::ops::fp8qs_cuda);
}
