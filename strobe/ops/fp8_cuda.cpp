// CUDA glue of fp8_quantize (kernels in cuda/fp8_kernels.cu): a given amax is only read.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda/fp8.h"
#include "strobe/ops/cuda_glue.h"
#include "strobe/ops/internal.h"

namespace strobe::ops {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8q_cuda(const at::Tensor& x, at::ScalarType dtype, bool transpose,
                                                         const std::optional<at::Tensor>& given) {
  detail::fp8_check_input(x, dtype, given);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dt = detail::kernel_dtype(x, "fp8_quantize (CUDA)", "x", detail::kFloatingTypes);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  const auto opts = x.options().dtype(dtype);
  at::Tensor q = at::empty({rows, cols}, opts);
  at::Tensor q_t = transpose ? at::empty({cols, rows}, opts) : at::empty({0}, opts);
  const bool amax_given = given && given->defined();
  at::Tensor amax = amax_given ? given->contiguous() : at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor scale_inv = at::empty({}, x.options().dtype(at::kFloat));
  const auto format = dtype == at::kFloat8_e4m3fn ? cuda::Fp8Format::kE4M3 : cuda::Fp8Format::kE5M2;
  C10_CUDA_CHECK(cuda::fp8_quantize(xc.data_ptr(), rows, cols, dt, format, q.data_ptr(),
                                    transpose ? q_t.data_ptr() : nullptr, amax.data_ptr<float>(), amax_given,
                                    scale_inv.data_ptr<float>(), detail::current_stream()));
  return {q, q_t, scale_inv};
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) { m.impl("fp8_quantize", &strobe::ops::fp8q_cuda); }
