// Schemas of every strobe op, declared once; kernels register beside their implementations
// (giou_loss.cpp, nonfinite_check.cpp, fused_optimizers.cpp and the *_cuda.cpp glue).
#include <torch/library.h>

TORCH_LIBRARY(strobe, m) {
  m.def("giou_loss(Tensor pred, Tensor target, str reduction=\"mean\") -> Tensor");
  m.def(
      "giou_loss_packed(Tensor pred, Tensor target, Tensor offsets, str reduction=\"mean\") -> "
      "Tensor");
  // Internal halves of giou_loss: the forward also returns d giou / d pred per box (when
  // with_grad) and the scale d loss / d giou, which the backward multiplies in.
  m.def(
      "giou_loss_fwd(Tensor pred, Tensor target, Tensor? offsets, int layout, int reduction, "
      "bool with_grad) -> (Tensor loss, Tensor grad_box, Tensor scale)");
  m.def(
      "giou_loss_bwd(Tensor grad_out, Tensor grad_box, Tensor scale, int reduction, "
      "ScalarType pred_dtype, int[] pred_shape) -> Tensor");
  m.def("nonfinite_check(Tensor[] tensors, bool compute_norm=False) -> (Tensor found, Tensor norm)");
  m.def(
      "fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, *, float lr, "
      "float beta1=0.9, float beta2=0.999, float eps=1e-8, float weight_decay=0., "
      "bool amsgrad=False, Tensor? found_nonfinite=None, Tensor? grad_multiplier=None) -> ()");
  m.def(
      "fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, *, float lr, "
      "float beta1=0.9, float beta2=0.999, float eps=1e-8, float weight_decay=0., "
      "bool amsgrad=False, Tensor? found_nonfinite=None, Tensor? grad_multiplier=None) -> ()");
  m.def(
      "fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor(c!)[] steps, *, float lr, float momentum=0., float dampening=0., "
      "float weight_decay=0., bool nesterov=False, Tensor? found_nonfinite=None, "
      "Tensor? grad_multiplier=None) -> ()");
}
