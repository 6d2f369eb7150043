// CUDA glue of linear_cross_entropy's kernels (cuda/fused_norm_kernels.cu): one chunk's loss per row
// and, with grad, softmax - onehot written over its logits in place (cross_entropy_rows); the
// backward's gradients times the incoming scalar gradient, d weight rounded from its fp32
// accumulator in the same pass (scale_by_device_scalar).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include "strobe/ops/cuda/cross_entropy.h"
#include "strobe/ops/cuda_glue.h"

namespace strobe::ops::detail {

void lce_rows_cuda(at::Tensor& logits, const at::Tensor& target, const at::Tensor& inv_count, at::Tensor& loss_rows,
                   int64_t ignore_index, bool grad) {
  TORCH_CHECK(logits.is_contiguous() && logits.dim() == 2 && target.is_contiguous() &&
                  target.scalar_type() == at::kLong && target.numel() == logits.size(0) &&
                  inv_count.scalar_type() == at::kFloat && inv_count.numel() == 1 &&
                  loss_rows.scalar_type() == at::kFloat && loss_rows.is_contiguous() &&
                  loss_rows.numel() == logits.size(0),
              "linear_cross_entropy (CUDA): internal chunk arguments out of shape");
  const c10::cuda::CUDAGuard guard(logits.device());
  cuda::CrossEntropyRowsParams p;
  p.logits = logits.data_ptr();
  p.target = target.data_ptr<int64_t>();
  p.inv_count = inv_count.data_ptr<float>();
  p.loss = loss_rows.data_ptr<float>();
  p.rows = logits.size(0);
  p.classes = logits.size(1);
  p.ignore_index = ignore_index;
  p.grad = grad;
  p.dtype = kernel_dtype(logits, "linear_cross_entropy (CUDA)", "hidden", kFloatingTypes);
  C10_CUDA_CHECK(cuda::cross_entropy_rows(p, current_stream()));
}

at::Tensor lce_scale_cuda(const at::Tensor& t, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(t.is_contiguous() && scale.scalar_type() == at::kFloat && scale.numel() == 1 && scale.is_cuda() &&
                  (dtype == t.scalar_type() || t.scalar_type() == at::kFloat),
              "linear_cross_entropy (CUDA): internal scale arguments out of shape");
  const c10::cuda::CUDAGuard guard(t.device());
  at::Tensor y = at::empty_like(t, t.options().dtype(dtype));
  const at::Tensor s = scale.contiguous();
  C10_CUDA_CHECK(cuda::scale_by_device_scalar(t.data_ptr(), kernel_dtype(t, "linear_cross_entropy (CUDA)", "gradient", kFloatingTypes),
                                              y.data_ptr(), kernel_dtype(y, "linear_cross_entropy (CUDA)", "gradient", kFloatingTypes),
                                              t.numel(), s.data_ptr<float>(), current_stream()));
  return y;
}

}  // namespace strobe::ops::detail
