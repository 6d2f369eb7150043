// Meta (fake) kernels of the GIoU, non-finite-check and fused-optimizer ops: output shapes and
// dtypes without touching data, so torch.compile / FakeTensor tracing and torch.library.opcheck
// see through them (flash_attention registers its own in flash_attention.cpp). Each mirrors what
// the real kernels return on the same inputs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "strobe/ops/internal.h"

namespace strobe::ops {
namespace {

using at::Tensor;
using at::TensorList;

std::tuple<Tensor, Tensor, Tensor> giou_fwd_meta(const Tensor& pred, const Tensor& target,
                                                 const std::optional<Tensor>& offsets,
                                                 int64_t layout, int64_t reduction,
                                                 bool with_grad) {
  detail::giou_check_inputs(pred, target, offsets, layout);
  TORCH_CHECK(reduction == detail::kNone || reduction == detail::kMean ||
                  reduction == detail::kSum,
              "giou_loss: unknown reduction ", reduction);
  const auto dt = pred.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto opt = pred.options().dtype(dt);
  // Symbolic sizes (torch.compile with dynamic shapes) flow through: no numel()/sizes().
  const c10::SymInt rows = pred.sym_numel() / 4;
  Tensor loss = reduction == detail::kNone
                    ? at::empty_symint(pred.sym_sizes().slice(0, pred.dim() - 1), opt)
                    : at::empty({}, opt);
  Tensor grad_box = with_grad ? at::empty_symint({rows, c10::SymInt(4)}, opt) : Tensor();
  // `none` has no scale (the backward multiplies grad_out per box), as the real kernels.
  return {loss, grad_box, reduction == detail::kNone ? Tensor() : at::empty({}, opt)};
}

Tensor giou_bwd_meta(const Tensor& grad_out, const Tensor& grad_box, const Tensor& scale,
                     int64_t reduction, at::ScalarType pred_dtype, c10::SymIntArrayRef pred_shape) {
  (void)scale;
  (void)reduction;
  TORCH_CHECK(grad_box.defined() && grad_box.dim() == 2 && grad_box.size(1) == 4,
              "giou_loss_bwd: grad_box must be [rows, 4]");
  return at::empty_symint(pred_shape, grad_out.options().dtype(pred_dtype));
}

Tensor giou_loss_meta(const Tensor& pred, const Tensor& target, std::string_view reduction) {
  const int64_t r = detail::parse_reduction(reduction, "giou_loss");
  return std::get<0>(giou_fwd_meta(pred, target, std::nullopt, detail::kPadded, r, false));
}

Tensor giou_loss_packed_meta(const Tensor& pred, const Tensor& target, const Tensor& offsets,
                             std::string_view reduction) {
  const int64_t r = detail::parse_reduction(reduction, "giou_loss");
  const int64_t layout = pred.dim() == 3 ? detail::kPackedTargets : detail::kPacked;
  return std::get<0>(giou_fwd_meta(pred, target, offsets, layout, r, false));
}

std::tuple<Tensor, Tensor> nonfinite_meta(TensorList tensors, bool compute_norm) {
  TORCH_CHECK(!tensors.empty(), "nonfinite_check: the tensor list is empty");
  const auto opt = tensors[0].options().dtype(at::kFloat);
  return {at::empty({}, opt), compute_norm ? at::empty({}, opt) : Tensor()};
}

// The optimizer steps only mutate their inputs: nothing to compute on Meta.
void adam_meta(TensorList, TensorList, TensorList, TensorList, TensorList, TensorList, double,
               double, double, double, double, bool, const std::optional<Tensor>&,
               const std::optional<Tensor>&, const std::optional<Tensor>&) {}
void sgd_meta(TensorList, TensorList, TensorList, TensorList, double, double, double, double, bool,
              const std::optional<Tensor>&, const std::optional<Tensor>&, const std::optional<Tensor>&) {}

void ema_meta(TensorList, TensorList, double, const std::optional<Tensor>&) {}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("giou", &strobe::ops::giou_loss_meta);
  m.impl("giou_packed", &strobe::ops::giou_loss_packed_meta);
  m.impl("giou_loss_fwd", &strobe::ops::giou_fwd_meta);
  m.impl("giou_loss_bwd", &strobe::ops::giou_bwd_meta);
  m.impl("nonfinite_check", &strobe::ops::nonfinite_meta);
  m.impl("fused_adamw_", &strobe::ops::adam_meta);
  m.impl("fused_adam_", &strobe::ops::adam_meta);
  m.impl("fused_sgd_", &strobe::ops::sgd_meta);
  m.impl("ema_update_", &strobe::ops::ema_meta);
}

// nonfinite_check's outputs are flags, not functions of the inputs to differentiate: autograd
// passes through (no "autograd kernel was not registered" warning when its inputs require grad).
TORCH_LIBRARY_IMPL(strobe, Autograd, m) {
  m.impl("nonfinite_check", torch::CppFunction::makeFallthrough());
}
