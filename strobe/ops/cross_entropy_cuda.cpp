// CUDA glue of cross_entropy_fwd / _bwd (kernels in cuda/fused_norm_kernels.cu).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda/cross_entropy.h"
#include "strobe/ops/cuda_glue.h"

namespace strobe::ops {
namespace detail {
void cross_entropy_check_inputs(const at::Tensor& logits, const at::Tensor& target);
}  // namespace detail

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

cuda::DType logits_dtype(const Tensor& logits) {
  return detail::kernel_dtype(logits, "cross_entropy (CUDA)", "logits", detail::kFloatingTypes);
}

std::tuple<Tensor, Tensor> ce_fwd_cuda(const Tensor& logits, const Tensor& target, int64_t ignore_index) {
  detail::cross_entropy_check_inputs(logits, target);
  const c10::cuda::CUDAGuard guard(logits.device());
  const Tensor lc = logits.contiguous(), tc = target.contiguous();
  const auto fopt = logits.options().dtype(at::kFloat);
  Tensor loss = at::empty({logits.size(0)}, fopt), lse = at::empty({logits.size(0)}, fopt);
  cuda::CrossEntropyFwdParams p;
  p.logits = lc.data_ptr();
  p.target = tc.data_ptr<int64_t>();
  p.loss = loss.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  p.rows = logits.size(0);
  p.classes = logits.size(1);
  p.ignore_index = ignore_index;
  p.dtype = logits_dtype(logits);
  C10_CUDA_CHECK(cuda::cross_entropy_fwd(p, detail::current_stream()));
  return {loss, lse};
}

Tensor ce_bwd_cuda(const Tensor& grad, const Tensor& logits, const Tensor& target, const Tensor& lse,
                const OptTensor& count, int64_t ignore_index) {
  detail::cross_entropy_check_inputs(logits, target);
  const bool per_row = grad.dim() == 1;
  TORCH_CHECK(grad.scalar_type() == at::kFloat && (grad.dim() == 0 || (per_row && grad.size(0) == logits.size(0))),
              "cross_entropy_bwd: grad must be fp32, a scalar or [N]");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 1 && lse.size(0) == logits.size(0),
              "cross_entropy_bwd: lse must be fp32 [N]");
  const bool has_count = count.has_value() && count->defined();
  TORCH_CHECK(!has_count || (count->scalar_type() == at::kFloat && count->numel() == 1),
              "cross_entropy_bwd: count must be one fp32 value");
  const c10::cuda::CUDAGuard guard(logits.device());
  const Tensor lc = logits.contiguous(), tc = target.contiguous(), gc = grad.contiguous(), sc = lse.contiguous();
  Tensor d = at::empty(logits.sizes(), lc.options());
  cuda::CrossEntropyBwdParams p;
  p.logits = lc.data_ptr();
  p.target = tc.data_ptr<int64_t>();
  p.lse = sc.data_ptr<float>();
  p.grad = gc.data_ptr<float>();
  p.count = has_count ? count->data_ptr<float>() : nullptr;
  p.per_row = per_row;
  p.dlogits = d.data_ptr();
  p.rows = logits.size(0);
  p.classes = logits.size(1);
  p.ignore_index = ignore_index;
  p.dtype = logits_dtype(logits);
  C10_CUDA_CHECK(cuda::cross_entropy_bwd(p, detail::current_stream()));
  return d;
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("cross_entropy_fwd", &strobe::ops::ce_fwd_cuda);
  m.impl("cross_entropy_bwd", &strobe::ops::ce_bwd_cuda);
}
