// CUDA glue of swiglu_fwd / swiglu_bwd (kernels in cuda/swiglu_kernels.cu).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda/swiglu.h"
#include "strobe/ops/cuda_glue.h"

namespace strobe::ops {
namespace detail {
void swiglu_check_input(const at::Tensor& gu);
}  // namespace detail

namespace {

at::Tensor sw_fwd_cuda(const at::Tensor& gu) {
  detail::swiglu_check_input(gu);
  const c10::cuda::CUDAGuard guard(gu.device());
  const auto dt = detail::kernel_dtype(gu, "swiglu (CUDA)", "gate_up", detail::kFloatingTypes);
  const at::Tensor g = gu.contiguous();
  auto sizes = gu.sizes().vec();
  sizes.back() /= 2;
  at::Tensor y = at::empty(sizes, g.options());
  const int64_t cols = sizes.back(), rows = cols == 0 ? 0 : y.numel() / cols;
  C10_CUDA_CHECK(cuda::swiglu_fwd(g.data_ptr(), y.data_ptr(), rows, cols, dt, detail::current_stream()));
  return y;
}

at::Tensor sw_bwd_cuda(const at::Tensor& dy, const at::Tensor& gu) {
  detail::swiglu_check_input(gu);
  const c10::cuda::CUDAGuard guard(gu.device());
  const auto dt = detail::kernel_dtype(gu, "swiglu (CUDA)", "gate_up", detail::kFloatingTypes);
  const int64_t cols = gu.size(-1) / 2;
  TORCH_CHECK(dy.scalar_type() == gu.scalar_type() && dy.numel() * 2 == gu.numel() && dy.size(-1) == cols,
              "swiglu_bwd: dy must be gate_up's shape with the last dimension halved, in its dtype");
  const at::Tensor d = dy.contiguous(), g = gu.contiguous();
  at::Tensor dgu = at::empty(gu.sizes(), g.options());
  const int64_t rows = cols == 0 ? 0 : d.numel() / cols;
  C10_CUDA_CHECK(cuda::swiglu_bwd(d.data_ptr(), g.data_ptr(), dgu.data_ptr(), rows, cols, dt, detail::current_stream()));
  return dgu;
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("swiglu_fwd", &strobe::ops::sw_fwd_cuda);
  m.impl("swiglu_bwd", &strobe::ops::sw_bwd_cuda);
}
