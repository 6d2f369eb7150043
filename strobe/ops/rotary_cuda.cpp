// CUDA glue of rotary_qk_apply (kernel in cuda/rotary_kernels.cu).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda/rotary.h"
#include "strobe/ops/cuda_glue.h"

namespace strobe::ops {
namespace detail {
void rotary_check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
}  // namespace detail

namespace {

std::tuple<at::Tensor, at::Tensor> rot_apply_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                  const at::Tensor& sin, bool backward) {
  detail::rotary_check_inputs(q, k, cos, sin);
  constexpr const char* op = "rotary_qk (CUDA)";
  const c10::cuda::CUDAGuard guard(q.device());
  cuda::RotaryParams p;
  p.dtype = detail::kernel_dtype(q, op, "q", detail::kFloatingTypes);
  p.head_dim = static_cast<int>(q.size(-1));
  TORCH_CHECK(p.head_dim <= cuda::rotary_max_head_dim(), op, ": head_dim must be at most ", cuda::rotary_max_head_dim(),
              ", got ", p.head_dim);
  TORCH_CHECK(q.size(-2) < (1 << 20) && k.size(-2) < (1 << 20), op, ": too many heads");
  p.q_heads = static_cast<int>(q.size(-2));
  p.k_heads = static_cast<int>(k.size(-2));
  p.tokens = q.numel() / std::max<int64_t>(1, q.size(-2) * q.size(-1));
  const at::Tensor qc = q.contiguous(), kc = k.contiguous();
  const at::Tensor cc = cos.to(at::kFloat).contiguous(), sc = sin.to(at::kFloat).contiguous();
  at::Tensor qo = at::empty(q.sizes(), qc.options()), ko = at::empty(k.sizes(), kc.options());
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.cos = cc.data_ptr<float>();
  p.sin = sc.data_ptr<float>();
  p.q_out = qo.data_ptr();
  p.k_out = ko.data_ptr();
  p.backward = backward;
  C10_CUDA_CHECK(cuda::rotary_qk(p, detail::current_stream()));
  return {qo, ko};
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) { m.impl("rotary_qk_apply", &strobe::ops::rot_apply_cuda); }
