// CUDA kernels of giou_loss_fwd / giou_loss_bwd (launchers in cuda/giou_kernels.cu).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda_glue.h"
#include "strobe/ops/internal.h"

namespace strobe::ops {
namespace {

using at::Tensor;

// Contiguous, with rows aligned for whole-row vector loads (a storage offset can break that).
Tensor rows_aligned(const Tensor& t) {
  Tensor c = t.contiguous();
  const auto addr = reinterpret_cast<uintptr_t>(c.data_ptr());
  if (addr % (4 * c.element_size()) != 0) c = c.clone(at::MemoryFormat::Contiguous);
  return c;
}

std::tuple<Tensor, Tensor, Tensor> giou_fwd_cuda(const Tensor& pred, const Tensor& target,
                                                 const std::optional<Tensor>& offsets,
                                                 int64_t layout, int64_t reduction,
                                                 bool with_grad) {
  detail::giou_check_inputs(pred, target, offsets, layout);
  TORCH_CHECK(reduction == detail::kNone || reduction == detail::kMean ||
                  reduction == detail::kSum,
              "giou_loss: unknown reduction ", reduction);
  detail::kernel_dtype(pred, "giou_loss (CUDA)", "pred", detail::kFloatingTypes);
  const c10::cuda::CUDAGuard guard(pred.device());
  const Tensor p = rows_aligned(pred), t = rows_aligned(target);
  const auto fopt = pred.options().dtype(at::kFloat);

  cuda::GiouFwdParams params;
  params.pred = p.data_ptr();
  params.target = t.data_ptr();
  params.pred_dtype = detail::kernel_dtype(p, "giou_loss (CUDA)", "pred", detail::kFloatingTypes);
  params.target_dtype = detail::kernel_dtype(t, "giou_loss (CUDA)", "target",
                                             {cuda::DType::kFloat32, cuda::DType::kBFloat16, cuda::DType::kFloat16,
                                              cuda::DType::kFloat64});
  params.layout = static_cast<cuda::GiouLayout>(layout);
  params.rows = p.numel() / 4;
  params.target_rows = t.numel() / 4;
  Tensor off;
  if (layout == detail::kPackedTargets) {
    off = offsets->contiguous();
    params.offsets = off.data_ptr<int64_t>();
    params.num_images = pred.size(0);
    params.boxes_per_image = pred.size(1);
  }
  Tensor loss, grad_box, scale;  // scale only for mean/sum: `none` scales by grad_out per box
  if (with_grad) {
    grad_box = at::empty({params.rows, 4}, fopt);
    params.grad_box = grad_box.data_ptr<float>();
  }
  const cudaStream_t stream = detail::current_stream();
  if (reduction == detail::kNone) {
    loss = at::empty(pred.sizes().slice(0, pred.dim() - 1), fopt);
    params.per_box_loss = loss.data_ptr<float>();
    C10_CUDA_CHECK(cuda::giou_fwd(params, stream));
  } else {
    const int64_t blocks = cuda::giou_fwd_num_blocks(params.rows);
    const Tensor partials = at::empty({2 * std::max<int64_t>(blocks, 1)}, fopt.dtype(at::kInt));
    params.partial_count = partials.data_ptr<int>();
    params.partial_sum = reinterpret_cast<float*>(params.partial_count + blocks);
    loss = at::empty({}, fopt);
    scale = at::empty({}, fopt);
    C10_CUDA_CHECK(cuda::giou_fwd(params, stream));
    C10_CUDA_CHECK(cuda::giou_finalize(params.partial_sum, params.partial_count, blocks,
                                       reduction == detail::kMean, loss.data_ptr<float>(),
                                       scale.data_ptr<float>(), stream));
  }
  return {loss, grad_box, scale};
}

Tensor giou_bwd_cuda(const Tensor& grad_out, const Tensor& grad_box, const Tensor& scale,
                     int64_t reduction, at::ScalarType pred_dtype, at::IntArrayRef pred_shape) {
  TORCH_CHECK(grad_box.defined() && grad_box.is_cuda() && grad_box.scalar_type() == at::kFloat &&
                  grad_box.dim() == 2 && grad_box.size(1) == 4 && grad_box.is_contiguous(),
              "giou_loss_bwd: grad_box must be a contiguous float32 CUDA [rows, 4] tensor");
  TORCH_CHECK(grad_out.device() == grad_box.device(),
              "giou_loss_bwd: grad_out and grad_box must be on one device");
  const int64_t rows = grad_box.size(0);
  const bool per_box = reduction == detail::kNone;
  TORCH_CHECK(per_box || (scale.defined() && scale.device() == grad_box.device() &&
                          scale.scalar_type() == at::kFloat && scale.numel() == 1),
              "giou_loss_bwd: scale must be a float32 scalar on the device of grad_box");
  TORCH_CHECK(per_box ? grad_out.numel() == rows : grad_out.numel() == 1,
              "giou_loss_bwd: grad_out has ", grad_out.numel(), " elements, expected ",
              per_box ? rows : 1);
  const c10::cuda::CUDAGuard guard(grad_box.device());
  const Tensor go = grad_out.to(at::kFloat).contiguous();
  Tensor grad_pred = at::empty(pred_shape, grad_box.options().dtype(pred_dtype));
  const cuda::DType dt = detail::kernel_dtype(pred_dtype, "giou_loss_bwd (CUDA)", "pred", detail::kFloatingTypes);
  C10_CUDA_CHECK(cuda::giou_bwd(go.data_ptr<float>(), per_box,
                                per_box ? nullptr : scale.data_ptr<float>(),
                                grad_box.data_ptr<float>(), grad_pred.data_ptr(), dt, rows,
                                detail::current_stream()));
  return grad_pred;
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("giou_loss_fwd", &strobe::ops::giou_fwd_cuda);
  m.impl("giou_loss_bwd", &strobe::ops::giou_bwd_cuda);
}
