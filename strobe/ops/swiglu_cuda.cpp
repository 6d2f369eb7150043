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

// amax (0-dim fp32) receives max |y| when defined.
at::Tensor sw_fwd_into(const at::Tensor& gu, const at::Tensor& amax) {
  detail::swiglu_check_input(gu);
  const c10::cuda::CUDAGuard guard(gu.device());
  const auto dt = detail::kernel_dtype(gu, "swiglu (CUDA)", "gate_up", detail::kFloatingTypes);
  const at::Tensor g = gu.contiguous();
  auto sizes = gu.sizes().vec();
  sizes.back() /= 2;
  at::Tensor y = at::empty(sizes, g.options());
  const int64_t cols = sizes.back(), rows = cols == 0 ? 0 : y.numel() / cols;
  C10_CUDA_CHECK(cuda::swiglu_fwd(g.data_ptr(), y.data_ptr(), rows, cols, dt,
                                  amax.defined() ? amax.data_ptr<float>() : nullptr, detail::current_stream()));
  return y;
}

// amax (0-dim fp32) receives max |d gate_up| when defined.
at::Tensor sw_bwd_into(const at::Tensor& dy, const at::Tensor& gu, const at::Tensor& amax) {
  detail::swiglu_check_input(gu);
  const c10::cuda::CUDAGuard guard(gu.device());
  const auto dt = detail::kernel_dtype(gu, "swiglu (CUDA)", "gate_up", detail::kFloatingTypes);
  const int64_t cols = gu.size(-1) / 2;
  TORCH_CHECK(dy.scalar_type() == gu.scalar_type() && dy.numel() * 2 == gu.numel() && dy.size(-1) == cols,
              "swiglu_bwd: dy must be gate_up's shape with the last dimension halved, in its dtype");
  const at::Tensor d = dy.contiguous(), g = gu.contiguous();
  at::Tensor dgu = at::empty(gu.sizes(), g.options());
  const int64_t rows = cols == 0 ? 0 : d.numel() / cols;
  C10_CUDA_CHECK(cuda::swiglu_bwd(d.data_ptr(), g.data_ptr(), dgu.data_ptr(), rows, cols, dt,
                                  amax.defined() ? amax.data_ptr<float>() : nullptr, detail::current_stream()));
  return dgu;
}

at::Tensor sw_fwd_cuda(const at::Tensor& gu) { return sw_fwd_into(gu, at::Tensor()); }
at::Tensor sw_bwd_cuda(const at::Tensor& dy, const at::Tensor& gu) { return sw_bwd_into(dy, gu, at::Tensor()); }
std::tuple<at::Tensor, at::Tensor> sw_fwd_amax_cuda(const at::Tensor& gu) {
  at::Tensor amax = at::empty({}, gu.options().dtype(at::kFloat));
  at::Tensor y = sw_fwd_into(gu, amax);
  return {y, amax};
}
std::tuple<at::Tensor, at::Tensor> sw_bwd_amax_cuda(const at::Tensor& dy, const at::Tensor& gu) {
  at::Tensor amax = at::empty({}, gu.options().dtype(at::kFloat));
  at::Tensor dgu = sw_bwd_into(dy, gu, amax);
  return {dgu, amax};
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("swiglu_fwd", &strobe::ops::sw_fwd_cuda);
  m.impl("swiglu_bwd", &strobe::ops::sw_bwd_cuda);
  m.impl("swiglu_fwd_amax", &strobe::ops::sw_fwd_amax_cuda);
  m.impl("swiglu_bwd_amax", &strobe::ops::sw_bwd_amax_cuda);
}
