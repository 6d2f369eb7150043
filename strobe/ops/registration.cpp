// Schemas of every strobe op, declared once; kernels register beside their implementations
// (giou_loss.cpp, nonfinite_check.cpp, fused_optimizers.cpp and the *_cuda.cpp glue).
#include <torch/library.h>

TORCH_LIBRARY(strobe, m) {
  // GIoU itself (higher is better; the seed's value), reduced over valid boxes. Not a loss to
  // minimise: generalized_box_iou_loss is (torchvision's 1 - GIoU).
  m.def("giou(Tensor pred, Tensor target, str reduction=\"mean\") -> Tensor");
  m.def(
      "giou_packed(Tensor pred, Tensor target, Tensor offsets, str reduction=\"mean\") -> "
      "Tensor");
  // torchvision.ops.generalized_box_iou_loss: 1 - GIoU per box pair over [..., 4], every pair
  // counted; reduction none (default, shape [...]), mean or sum.
  m.def(
      "generalized_box_iou_loss(Tensor pred, Tensor target, str reduction=\"none\") -> Tensor");
  // Internal halves of giou: the forward also returns d giou / d pred per box (when
  // with_grad) and the scale d loss / d giou, which the backward multiplies in.
  m.def(
      "giou_loss_fwd(Tensor pred, Tensor target, Tensor? offsets, int layout, int reduction, "
      "bool with_grad) -> (Tensor loss, Tensor grad_box, Tensor scale)");
  m.def(
      "giou_loss_bwd(Tensor grad_out, Tensor grad_box, Tensor scale, int reduction, "
      "ScalarType pred_dtype, SymInt[] pred_shape) -> Tensor");
  // y = relu(max_pool2d(conv2d(x * input_scale, weight, bias, padding=1), 2)) fused (docs/OPS.md);
  // x float or uint8 [N, C, H, W], weight [C_out, C, 3, 3]; out_dtype defaults to x's (fp32 for uint8).
  m.def(
      "conv3x3_maxpool_relu(Tensor x, Tensor weight, Tensor bias, float input_scale=1., "
      "ScalarType? out_dtype=None) -> Tensor");
  // Internal halves: the forward also returns the uint8 mask (argmax of each 2x2 window | ReLU
  // bit) that the backward reads instead of recomputing the convolution.
  m.def(
      "conv3x3_maxpool_relu_fwd(Tensor x, Tensor weight, Tensor bias, float input_scale, "
      "ScalarType out_dtype) -> (Tensor y, Tensor mask)");
  m.def(
      "conv3x3_maxpool_relu_bwd(Tensor grad_y, Tensor x, Tensor weight, Tensor mask, "
      "float input_scale, bool input_grad) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)");
  // Training-mode BatchNorm2d over (N, H, W) of x [N, C, H, W], then + residual, then ReLU, in one op
  // (docs/OPS.md); running statistics updated in place (momentum as nn.BatchNorm2d's).
  m.def(
      "batch_norm_act(Tensor x, Tensor weight, Tensor bias, Tensor(a!) running_mean, "
      "Tensor(b!) running_var, Tensor? residual=None, float momentum=0.1, float eps=1e-5, "
      "bool relu=True) -> Tensor");
  // Internal halves: the forward also returns the batch mean and invstd (fp32 [C]); the backward
  // reads the ReLU mask from y.
  m.def(
      "batch_norm_act_fwd(Tensor x, Tensor weight, Tensor bias, Tensor(a!) running_mean, "
      "Tensor(b!) running_var, Tensor? residual, float momentum, float eps, bool relu) -> "
      "(Tensor y, Tensor mean, Tensor invstd)");
  m.def(
      "batch_norm_act_bwd(Tensor grad_y, Tensor y, Tensor x, Tensor weight, Tensor mean, "
      "Tensor invstd, bool relu, bool residual_grad) -> (Tensor grad_x, Tensor grad_weight, "
      "Tensor grad_bias, Tensor grad_residual)");
  // 2-D max-pool, torch.nn.functional.max_pool2d's signature (dilation 1 and ceil_mode False only);
  // the backward reads a one-byte argmax per output (docs/OPS.md).
  m.def(
      "max_pool2d(Tensor x, int[2] kernel_size, int[2] stride=[], int[2] padding=0, int[2] dilation=1, "
      "bool ceil_mode=False) -> Tensor");
  // Internal halves: the forward also returns the uint8 index (position of the maximum inside its
  // window); the backward gathers grad_y into an input of input_size (channels_last: its layout).
  m.def("max_pool2d_fwd(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding) -> (Tensor y, Tensor index)");
  m.def(
      "max_pool2d_bwd(Tensor grad_y, Tensor index, SymInt[] input_size, int[2] kernel_size, int[2] stride, "
      "int[2] padding, bool channels_last) -> Tensor");
  // sum = x + delta, y = LayerNorm(sum) over the last dim (weight, optional bias), fused forward
  // and backward; layer_norm is the same without delta (docs/OPS.md).
  m.def(
      "add_layer_norm(Tensor x, Tensor delta, Tensor weight, Tensor? bias=None, float eps=1e-5) -> "
      "(Tensor sum, Tensor y)");
  m.def("layer_norm(Tensor x, Tensor weight, Tensor? bias=None, float eps=1e-5) -> Tensor");
  // Internal halves: the forward also returns the fp32 row statistics (x.shape[:-1]); sum is
  // undefined without delta. The backward's dx includes dsum (the residual path's gradient).
  m.def(
      "add_layer_norm_fwd(Tensor x, Tensor? delta, Tensor weight, Tensor? bias, float eps) -> "
      "(Tensor y, Tensor mean, Tensor rstd, Tensor sum)");
  m.def(
      "add_layer_norm_bwd(Tensor dy, Tensor? dsum, Tensor input, Tensor mean, Tensor rstd, "
      "Tensor weight, bool has_bias) -> (Tensor dx, Tensor dweight, Tensor dbias)");
  // add_layer_norm and max |y| (fp32, 0-dim; NaN when y holds one), found by the forward kernel as it
  // writes y: the amax of a float8 quantization of y (the float8 linear that reads it). y_amax is not
  // differentiable; the rest is add_layer_norm, bit for bit. The internal forward half likewise.
  m.def(
      "add_layer_norm_amax(Tensor x, Tensor delta, Tensor weight, Tensor? bias=None, float eps=1e-5) -> "
      "(Tensor sum, Tensor y, Tensor y_amax)");
  m.def(
      "add_layer_norm_fwd_amax(Tensor x, Tensor? delta, Tensor weight, Tensor? bias, float eps) -> "
      "(Tensor y, Tensor mean, Tensor rstd, Tensor sum, Tensor y_amax)");
  // sum = x + delta, y = RMSNorm(sum) * weight over the last dim in Hugging Face's numerics, fused
  // forward and backward; rms_norm is the same without delta (docs/OPS.md).
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps=1e-6) -> (Tensor sum, Tensor y)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor");
  // Internal halves: the forward also returns the fp32 1 / rms of every row (x.shape[:-1]); sum is
  // undefined without delta. The backward's dx includes dsum.
  m.def("add_rms_norm_fwd(Tensor x, Tensor? delta, Tensor weight, float eps) -> (Tensor y, Tensor rstd, Tensor sum)");
  m.def(
      "add_rms_norm_bwd(Tensor dy, Tensor? dsum, Tensor input, Tensor rstd, Tensor weight) -> "
      "(Tensor dx, Tensor dweight)");
  // add_rms_norm and max |y| from the forward kernel, as add_layer_norm_amax.
  m.def("add_rms_norm_amax(Tensor x, Tensor delta, Tensor weight, float eps=1e-6) -> (Tensor sum, Tensor y, Tensor y_amax)");
  m.def(
      "add_rms_norm_fwd_amax(Tensor x, Tensor? delta, Tensor weight, float eps) -> "
      "(Tensor y, Tensor rstd, Tensor sum, Tensor y_amax)");
  // Rotary position embedding of q [..., Hq, D] and k [..., Hk, D] with cos / sin [..., D] (one row per
  // token) in Hugging Face's rotate-half convention and numerics (docs/OPS.md).
  m.def("rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor q_out, Tensor k_out)");
  // Internal: the rotation (backward=False) or its inverse, the gradient (backward=True).
  m.def("rotary_qk_apply(Tensor q, Tensor k, Tensor cos, Tensor sin, bool backward) -> (Tensor q_out, Tensor k_out)");
  // silu(gate) * up over one [..., 2 x F] projection output (gate first), fused forward and backward.
  m.def("swiglu(Tensor gate_up) -> Tensor");
  // Internal halves: the backward recomputes silu(gate) and returns d gate_up ([..., 2 x F]).
  m.def("swiglu_fwd(Tensor gate_up) -> Tensor");
  m.def("swiglu_bwd(Tensor dy, Tensor gate_up) -> Tensor");
  // Internal: the halves that also return the max |output| (fp32, NaN when the output holds one), the
  // amax of a float8 quantization of that output (fp8_linear_swiglu).
  m.def("swiglu_fwd_amax(Tensor gate_up) -> (Tensor y, Tensor amax)");
  m.def("swiglu_bwd_amax(Tensor dy, Tensor gate_up) -> (Tensor dgate_up, Tensor amax)");
  // A 2-D tensor's float8 copy, its transpose when asked (else a [0] tensor) and the fp32 dequantization
  // scale, with tensorwise dynamic scaling (docs/OPS.md): the operands of a scaled GEMM.
  // amax: max |x| when its producer computed it (a 0-dim fp32 tensor on x's device): the pass over x
  // that would find it is skipped.
  m.def(
      "fp8_quantize(Tensor x, ScalarType dtype, bool transpose=False, Tensor? amax=None) -> "
      "(Tensor q, Tensor q_t, Tensor scale_inv)");
  // Internal: fp8_quantize and the fp32 sums of x's columns ([cols]) from the cast's read of x (a
  // float8 linear's bias gradient).
  m.def(
      "fp8_quantize_sum(Tensor x, ScalarType dtype, bool transpose=False, Tensor? amax=None) -> "
      "(Tensor q, Tensor q_t, Tensor scale_inv, Tensor col_sum)");
  // y = x weight^T (+ bias) with its GEMMs (forward, d x, d weight) in float8 (docs/OPS.md).
  // x_amax: max |x| when its producer computed it (fp8_quantize's amax).
  m.def("fp8_linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? x_amax=None) -> Tensor");
  // swiglu(x weight^T) with the GEMMs of x weight^T in float8, weight [2 x F, in_features] (gate rows
  // first), and max |y| for the float8 linear that reads y: the amax of the output from swiglu's kernel
  // and, in the backward, the amax of d gate_up from swiglu's backward kernel (docs/OPS.md).
  m.def("fp8_linear_swiglu(Tensor x, Tensor weight, Tensor? x_amax=None) -> (Tensor y, Tensor y_amax)");
  // Internal halves: the forward also returns the float8 transposes the backward reads (empty unless
  // asked) and their dequantization scales; the backward makes the gradients output_mask asks for.
  m.def(
      "fp8_linear_fwd(Tensor x, Tensor weight, Tensor? bias, bool save_x_t, bool save_w_t, Tensor? x_amax=None) -> "
      "(Tensor y, Tensor x_t, Tensor x_scale_inv, Tensor w_t, Tensor w_scale_inv)");
  m.def(
      "fp8_linear_bwd(Tensor dy, Tensor x_t, Tensor x_scale_inv, Tensor w_t, Tensor w_scale_inv, "
      "ScalarType weight_dtype, ScalarType? bias_dtype, bool[3] output_mask, Tensor? dy_amax=None) -> "
      "(Tensor dx, Tensor dweight, Tensor dbias)");
  // The LM head and its cross-entropy without the logits: hidden [N, C], weight [V, C], bias [V]?,
  // int64 target [N]; the mean fp32 loss over tokens not ignored (docs/OPS.md). chunk_rows 0: automatic.
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore_index=-100, "
      "int chunk_rows=0) -> Tensor");
  // Internal: the loss and, with with_grad, its gradients (dhidden in hidden's dtype; dweight and dbias
  // in their fp32 accumulator, fp64 for fp64).
  m.def(
      "linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore_index, "
      "int chunk_rows, bool with_grad) -> (Tensor loss, Tensor dhidden, Tensor dweight, Tensor dbias)");
  // Internal: its backward, grad * scale rounded once to dtype (scale: the incoming scalar gradient).
  m.def("linear_cross_entropy_scale(Tensor grad, Tensor scale, ScalarType dtype) -> Tensor");
  // Softmax cross-entropy over logits [N, V] with int64 targets [N]; fp32 loss (docs/OPS.md).
  m.def(
      "cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, str reduction=\"mean\") "
      "-> Tensor");
  // Internal halves: per-row loss and logsumexp (fp32 [N]); the backward takes d loss (a scalar,
  // or [N] for reduction none) and, for mean, the count of non-ignored rows.
  m.def("cross_entropy_fwd(Tensor logits, Tensor target, int ignore_index) -> (Tensor loss, Tensor lse)");
  m.def(
      "cross_entropy_bwd(Tensor grad, Tensor logits, Tensor target, Tensor lse, Tensor? count, "
      "int ignore_index) -> Tensor");
  // y = fc2(gelu_tanh(fc1(x))) as one function; on CUDA the GELU and fc1's bias gradient ride in
  // cuBLASLt epilogues (docs/OPS.md). w1 [H, C], b1 [H], w2 [N, H], b2 [N], all of x's dtype.
  m.def("fused_mlp(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2) -> Tensor");
  // Internal halves: the forward also returns act = gelu(pre) and pre ([rows, H], x's dtype).
  m.def(
      "fused_mlp_fwd(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2) -> "
      "(Tensor y, Tensor act, Tensor pre)");
  m.def(
      "fused_mlp_bwd(Tensor dy, Tensor x, Tensor w1, Tensor w2, Tensor act, Tensor pre) -> "
      "(Tensor dx, Tensor dw1, Tensor db1, Tensor dw2, Tensor db2)");
  m.def("nonfinite_check(Tensor[] tensors, bool compute_norm=False) -> (Tensor found, Tensor norm)");
  m.def(
      "fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, *, float lr, "
      "float beta1=0.9, float beta2=0.999, float eps=1e-8, float weight_decay=0., "
      "bool amsgrad=False, Tensor? found_nonfinite=None, Tensor? grad_multiplier=None, "
      "Tensor? lr_tensor=None) -> ()");
  m.def(
      "fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, *, float lr, "
      "float beta1=0.9, float beta2=0.999, float eps=1e-8, float weight_decay=0., "
      "bool amsgrad=False, Tensor? found_nonfinite=None, Tensor? grad_multiplier=None, "
      "Tensor? lr_tensor=None) -> ()");
  m.def(
      "fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor(c!)[] steps, *, float lr, float momentum=0., float dampening=0., "
      "float weight_decay=0., bool nesterov=False, Tensor? found_nonfinite=None, "
      "Tensor? grad_multiplier=None, Tensor? lr_tensor=None) -> ()");
  // Weight averaging (the ema callback): averages[i] += weight * (sources[i] - averages[i]) in
  // fp32, nothing when skip (a 0-d float32 device flag) is non-zero.
  m.def("ema_update_(Tensor(a!)[] averages, Tensor[] sources, *, float weight, Tensor? skip=None) -> ()");
  // Attention over [B, S, H, D] (or packed [T, H, D] with int32 cu_seqlens_q/k [B + 1] and host
  // max_seqlen_q/k); returns the output and the logsumexp (fp32, [B, H, Sq] or [H, Tq]).
  m.def(
      "flash_attention(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0, bool causal=False, "
      "float? softmax_scale=None, bool deterministic=False) -> (Tensor out, Tensor lse)");
  // Internal halves of flash_attention (the softmax scale resolved).
  m.def(
      "flash_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, "
      "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, "
      "float softmax_scale) -> (Tensor out, Tensor lse)");
  m.def(
      "flash_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, bool causal, float softmax_scale, bool deterministic) -> "
      "(Tensor dq, Tensor dk, Tensor dv)");
}
