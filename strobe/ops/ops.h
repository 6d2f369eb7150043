// Strobe's custom operators (TORCH_LIBRARY namespace `strobe`), callable from C++ through these
// wrappers or from Python after torch.ops.load_library("libstrobe_ops.so") as torch.ops.strobe.*.
// Each op has a CPU reference in ATen ops and, when built with CUDA, a CUDA kernel; see docs/OPS.md.
#pragma once

#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include <torch/types.h>

namespace strobe::ops {

// GIoU of predictions against padded targets, both [B, N, 4] as (x1, y1, x2, y2) (op strobe::giou).
// The value is GIoU itself, higher is better, NOT a loss to minimise (generalized_box_iou_loss
// below is): the GIoU of bench/pytorch_baselines.py's generalized_box_iou(target, pred), so that
// `mean` equals the seed's loss_with_padding(pred, target) one to one.
// A box counts when its target's last coordinate is > 0 (zero padding is invalid).
//   mean: sum over valid boxes / max(#valid, 1) (0 for an all-invalid batch), sum: the sum,
//   none: per box [B, N], 0 for invalid boxes.
// pred: fp32, bf16 or fp16 (also fp64 on CPU), read natively; target: any floating type.
// The result is fp32 (fp64 when pred is fp64). Differentiable in pred; the gradient of invalid
// boxes is exactly 0. Deterministic (no floating-point atomics).
torch::Tensor giou(const torch::Tensor& pred, const torch::Tensor& target,
                   std::string_view reduction = "mean");

// Packed variant (op strobe::giou_packed): targets [T, 4] of B images back to back, offsets [B + 1]
// (int64, offsets[0] = 0, non-decreasing, offsets[B] = T) and either
//   pred [B, N, 4]: image b's j-th target pairs with pred[b, j] (j < its count <= N), other
//                   prediction rows are ignored (zero gradient; 0 in `none`, shape [B, N]);
//   pred [T, 4]:    row t pairs with target row t (`none` gives [T]).
// Every packed target row is valid. Offsets are checked on CPU; on CUDA the kernel guards against
// out-of-range rows instead of syncing to check them.
torch::Tensor giou_packed(const torch::Tensor& pred, const torch::Tensor& target,
                          const torch::Tensor& offsets, std::string_view reduction = "mean");

// Deprecated names of giou / giou_packed (they return GIoU, not a loss); kept only until
// tasks/detection.cpp moves to giou().
inline torch::Tensor giou_loss(const torch::Tensor& pred, const torch::Tensor& target,
                               std::string_view reduction = "mean") {
  return giou(pred, target, reduction);
}
inline torch::Tensor giou_loss_packed(const torch::Tensor& pred, const torch::Tensor& target,
                                      const torch::Tensor& offsets,
                                      std::string_view reduction = "mean") {
  return giou_packed(pred, target, offsets, reduction);
}

// torchvision.ops.generalized_box_iou_loss (op strobe::generalized_box_iou_loss): 1 - GIoU for
// every pair of boxes pred[..., 4] / target[..., 4] (no padding rule: every pair counts);
// reduction "none" (shape [...]), "mean" (0 for zero pairs; torchvision: NaN) or "sum". fp32
// result (fp64 for fp64 pred); differentiable in pred; the GIoU kernels of giou_packed underneath.
torch::Tensor generalized_box_iou_loss(const torch::Tensor& pred, const torch::Tensor& target,
                                       std::string_view reduction = "none");

// One pass over all tensors (any floating dtype, one device): found = 1.0 if any element is NaN or
// +-Inf else 0.0, a 0-dim fp32 tensor on that device; when compute_norm, also the total L2 norm
// sqrt(sum of squares over all tensors) as a 0-dim fp32 tensor (undefined otherwise). No host sync.
std::tuple<torch::Tensor, torch::Tensor> nonfinite_check(torch::TensorList tensors,
                                                         bool compute_norm = false);

// Functional multi-tensor optimizer steps behind FusedAdamW/FusedAdam/FusedSGD (see
// fused_optimizers.h for the classes, which manage the state lists). All lists are parallel and on
// one device; params, state and steps fp32 on CUDA (params any float type on CPU); grads fp32, bf16
// or fp16. `steps` are 0-dim fp32 per-parameter step counts, incremented on the device unless
// skipped. When found_nonfinite (0-dim fp32) is given and nonzero, nothing changes. Gradients are
// multiplied by grad_multiplier (0-dim fp32) when given: unscaling and clipping in the same pass.
struct AdamArgs {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool amsgrad = false;
  // When defined (a 0-dim float64 on the parameters' device), the step reads the learning rate from
  // it instead of `lr`: a CUDA graph replays the captured step with the current value.
  torch::Tensor lr_tensor;
};
void fused_adamw_(torch::TensorList params, torch::TensorList grads, torch::TensorList exp_avgs,
                  torch::TensorList exp_avg_sqs, torch::TensorList max_exp_avg_sqs,
                  torch::TensorList steps, const AdamArgs& args,
                  const torch::Tensor& found_nonfinite = {},
                  const torch::Tensor& grad_multiplier = {});
// Adam with L2 weight decay (grad += wd * param), as torch::optim::Adam.
void fused_adam_(torch::TensorList params, torch::TensorList grads, torch::TensorList exp_avgs,
                 torch::TensorList exp_avg_sqs, torch::TensorList max_exp_avg_sqs,
                 torch::TensorList steps, const AdamArgs& args,
                 const torch::Tensor& found_nonfinite = {},
                 const torch::Tensor& grad_multiplier = {});

struct SgdArgs {
  double lr = 1e-3, momentum = 0.0, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = false;
  torch::Tensor lr_tensor;  // as AdamArgs::lr_tensor
};
// momentum_buffers and steps are empty when momentum == 0; a buffer whose step is 0 is initialised
// with the gradient (torch::optim::SGD's first step).
void fused_sgd_(torch::TensorList params, torch::TensorList grads,
                torch::TensorList momentum_buffers, torch::TensorList steps, const SgdArgs& args,
                const torch::Tensor& found_nonfinite = {},
                const torch::Tensor& grad_multiplier = {});

// The exponential moving average's update, one multi-tensor launch on CUDA: averages[i] (dense fp32)
// += weight * (sources[i] - averages[i]), sources of any floating dtype laid out like their average;
// nothing at all when `skip` (a 0-d float32 flag on the averages' device, read there: no host sync
// on CUDA) is non-zero.
void ema_update_(torch::TensorList averages, torch::TensorList sources, double weight, const torch::Tensor& skip = {});

// Flash attention (FlashAttention-2 style on tensor cores; docs/OPS.md). q [B, Sq, H, D],
// k/v [B, Sk, H, D]; only the last dimension must be contiguous (views of a fused qkv projection
// need no copy). causal is bottom-right aligned (row r sees key c <= r + Sk - Sq); a row that sees
// no key gives 0 and LSE = +inf. softmax_scale defaults to 1/sqrt(D). Returns (out [B, Sq, H, D],
// lse [B, H, Sq] fp32, natural log). Differentiable in q, k, v (not lse).
// CUDA: bf16/fp16, head_dim 64 or 128, batch*heads <= 65535; anything else is an error. The
// backward is deterministic whatever `deterministic` says (no atomics; the flag is kept for API
// parity with FlashAttention). CPU (and Meta): flash_attention_reference.
std::tuple<torch::Tensor, torch::Tensor> flash_attention(const torch::Tensor& q,
                                                         const torch::Tensor& k,
                                                         const torch::Tensor& v,
                                                         bool causal = false,
                                                         std::optional<double> softmax_scale = {},
                                                         bool deterministic = false);
// Packed (varlen): q [Tq, H, D], k/v [Tk, H, D]; sequence b is rows cu_seqlens[b] .. [b+1]
// (int32 [B + 1] on q's device, checked on CPU, trusted on CUDA so nothing syncs); max_seqlen_q/k
// are host ints >= every length. lse is [H, Tq]; rows past cu_seqlens[-1] give 0 / +inf.
std::tuple<torch::Tensor, torch::Tensor> flash_attention_varlen(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool causal = false, std::optional<double> softmax_scale = {},
    bool deterministic = false);
// The reference: the op's signature (without `deterministic`) in ATen ops on any device and
// dtype, computed in fp32 (fp64 for fp64 inputs), differentiable by autograd. It is the op's CPU
// kernel and the models' `attention: math` backend; lse is fp32 (fp64 for fp64 inputs).
std::tuple<torch::Tensor, torch::Tensor> flash_attention_reference(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const std::optional<torch::Tensor>& cu_seqlens_q, const std::optional<torch::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    std::optional<double> softmax_scale = {});
// Whether the CUDA kernels on the current device are the Hopper ones (warpgroup MMAs: forward and
// backward v4, compute capability 9.0) rather than the mma.sync ones every other GPU runs (forward
// v3, backward v1; also on Hopper with STROBE_FLASH_ATTN=mma in the environment). false without
// CUDA kernels.
bool flash_attention_uses_wgmma();
// Whether flash_attention's CUDA kernels take heads of this size in this dtype (head_dim 64 or 128,
// bf16 or fp16); false in a build without them. `attention: custom` asks it before training
// (models/attention.h, check_attention_on_device).
bool flash_attention_cuda_takes(int64_t head_dim, torch::ScalarType dtype);

// Fused conv3x3 (padding 1) + max-pool 2x2 (stride 2, floor) + ReLU (op strobe::conv3x3_maxpool_relu):
// y = relu(max_pool2d(conv2d(x * input_scale, weight, bias, padding=1), 2)), computed in fp32
// (fp64 on CPU for fp64 inputs). x [N, C, H, W] float32/bf16/fp16 or uint8 (any float type on CPU),
// weight [C_out, C, 3, 3], bias [C_out]; y [N, C_out, H/2, W/2] in out_dtype (default: x's dtype,
// fp32 for uint8 x). Differentiable in x (floating only), weight and bias; the max-pool gradient goes
// to the first maximum of each window (PyTorch's rule). CUDA: direct convolution kernels for thin
// channel counts (C <= 64, N <= 65535); CPU and Meta: ATen. docs/OPS.md.
torch::Tensor conv3x3_maxpool_relu(const torch::Tensor& x, const torch::Tensor& weight,
                                   const torch::Tensor& bias, double input_scale = 1.0,
                                   std::optional<at::ScalarType> out_dtype = {});
// The same function in plain ATen ops (conv2d, max_pool2d, relu), differentiable by autograd; the
// tests' reference.
torch::Tensor conv3x3_maxpool_relu_reference(const torch::Tensor& x, const torch::Tensor& weight,
                                             const torch::Tensor& bias, double input_scale = 1.0,
                                             std::optional<at::ScalarType> out_dtype = {});

// Training-mode BatchNorm2d, then + residual, then ReLU, in one op (op strobe::batch_norm_act):
// y = act(weight * (x - mean) * invstd + bias [+ residual]) with the batch statistics over (N, H, W)
// (biased variance in invstd), running_mean/running_var updated in place as nn::BatchNorm2d does
// (momentum, unbiased variance). Differentiable in x, weight, bias and residual. CUDA: x channels_last
// (C % 8 == 0, fp32/bf16/fp16), fp32 weight, bias and running stats; statistics and gradients reduced
// in a fixed order (deterministic). CPU and Meta: ATen in fp32 (fp64 for fp64 x). docs/OPS.md.
torch::Tensor batch_norm_act(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                             torch::Tensor& running_mean, torch::Tensor& running_var,
                             const std::optional<torch::Tensor>& residual = std::nullopt, double momentum = 0.1,
                             double eps = 1e-5, bool relu = true);
// Whether batch_norm_act's CUDA kernels take these tensors as they are (a build with CUDA kernels,
// x on CUDA, channels_last, C % 8 == 0, fp32/bf16/fp16; fp32 weight, bias and running stats).
bool batch_norm_act_cuda_eligible(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                  const torch::Tensor& running_mean, const torch::Tensor& running_var);
// 2-D max-pool (op strobe::max_pool2d), torch::max_pool2d's arguments and results: kernel_size,
// stride (empty = kernel_size) and padding as one or two ints; padding counts as -inf (never wins).
// Within a window the first maximum in row-major order wins and a NaN takes over (the output is NaN
// when the window holds one), as ATen. Only dilation 1 and ceil_mode false (anything else is an
// error), kernel_h * kernel_w <= 256, x [N, C, H, W] floating. Differentiable in x: the forward keeps
// a one-byte argmax per output (not ATen's int64) and the backward is a deterministic gather (each
// input element sums the gradients of the outputs that chose it). The output and gradient keep x's
// layout (channels_last or contiguous). CUDA: fp32/bf16/fp16, NHWC vectorized over channels (16-byte
// accesses when C is a multiple of 16 / element size) or NCHW. CPU (any floating type) and Meta:
// loops of the same algorithm, the reference. docs/OPS.md.
torch::Tensor max_pool2d(const torch::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride = {},
                         at::IntArrayRef padding = 0, at::IntArrayRef dilation = 1, bool ceil_mode = false);
// Whether max_pool2d's CUDA kernels take x as it is (a build with CUDA kernels, x on CUDA, 4-D,
// fp32/bf16/fp16, contiguous or channels_last).
bool max_pool2d_cuda_eligible(const torch::Tensor& x);

// Fused residual add + LayerNorm (op strobe::add_layer_norm): sum = x + delta (x's dtype),
// y = (sum - mean) / sqrt(var + eps) * weight (+ bias) over the last dimension (biased variance,
// statistics in fp32 from the rounded sum), y in x's dtype. x and delta share shape and dtype
// (fp32/bf16/fp16; also fp64 on CPU); weight [C] and optional bias [C] any float type. Differentiable
// in x, delta, weight, bias: d x = d delta = d sum + d LN(sum) in one pass. CUDA: C <= 4096, dweight /
// dbias deterministic (per-block partials summed in a fixed order). CPU and Meta: ATen (the
// reference, fp32 or fp64). Returns (sum, y). docs/OPS.md.
std::tuple<torch::Tensor, torch::Tensor> add_layer_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                        const torch::Tensor& weight,
                                                        const std::optional<torch::Tensor>& bias = {},
                                                        double eps = 1e-5);
// add_layer_norm and max |y| (op strobe::add_layer_norm_amax; fp32, 0-dim, NaN when y holds one, not
// differentiable), found by the forward kernel as it writes y: the amax of the float8 quantization of
// y by the float8 linear that reads it (fp8_linear's x_amax). (sum, y) are add_layer_norm's, bit for bit.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> add_layer_norm_amax(const torch::Tensor& x,
                                                                            const torch::Tensor& delta,
                                                                            const torch::Tensor& weight,
                                                                            const std::optional<torch::Tensor>& bias = {},
                                                                            double eps = 1e-5);
// The same LayerNorm without the add (op strobe::layer_norm): y = LN(x).
torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& weight,
                         const std::optional<torch::Tensor>& bias = {}, double eps = 1e-5);

// Fused residual add + RMSNorm (op strobe::add_rms_norm) in Hugging Face's LlamaRMSNorm numerics:
// sum = x + delta (x's dtype), rstd = 1 / sqrt(mean(sum^2) + eps) in fp32, y = weight * (sum * rstd)
// with the normalised row rounded to x's dtype before the product and the product rounded again.
// x and delta share shape and dtype (fp32/bf16/fp16; also fp64 on CPU); weight [C] of a dtype that
// does not promote x's (y keeps x's dtype). Differentiable in x, delta, weight: d x = d delta =
// d sum + d RMSNorm(sum) in one pass. CUDA: C <= 4096, dweight deterministic. CPU and Meta: ATen (the
// reference). Returns (sum, y). docs/OPS.md.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                      const torch::Tensor& weight, double eps = 1e-6);
// add_rms_norm and max |y| from the forward kernel (op strobe::add_rms_norm_amax), as add_layer_norm_amax.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> add_rms_norm_amax(const torch::Tensor& x,
                                                                          const torch::Tensor& delta,
                                                                          const torch::Tensor& weight, double eps = 1e-6);
// The same RMSNorm without the add (op strobe::rms_norm).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps = 1e-6);

// Rotary position embedding of q and k in one op (op strobe::rotary_qk), Hugging Face's rotate-half
// convention: x * cos + rotate_half(x) * sin per head, cos / sin cast to x's dtype and every product
// and sum rounded to it as transformers' ATen ops round them (the backward as autograd rounds it:
// bit for bit on CPU and CUDA). q [..., Hq, D], k [..., Hk, D] (one dtype: fp32/bf16/fp16, also fp64
// on CPU; D even), cos / sin [..., D] with q's leading dimensions (one row per token, e.g. from the
// batch's position ids, so packed sequences restart per document). Differentiable in q and k; the
// backward is the inverse rotation and keeps only cos / sin. CUDA: one kernel for both, no copy of
// the rotated half. Returns (q', k'). docs/OPS.md.
std::tuple<torch::Tensor, torch::Tensor> rotary_qk(const torch::Tensor& q, const torch::Tensor& k,
                                                   const torch::Tensor& cos, const torch::Tensor& sin);

// SwiGLU of one projection output (op strobe::swiglu): gate_up [..., 2 x F] holds gate in its first F
// columns and up in its last F (one GEMM against the two weights stacked); returns silu(gate) * up
// [..., F] in gate_up's dtype (fp32/bf16/fp16; also fp64 on CPU). The CPU kernel is transformers'
// `act_fn(gate) * up` op for op; CUDA rounds where ATen rounds (within one rounding of ATen's own
// CUDA ops, which may fuse a multiply-add). Differentiable; the backward recomputes silu(gate) from
// the saved gate_up instead of keeping it. docs/OPS.md.
torch::Tensor swiglu(const torch::Tensor& gate_up);

// A 2-D tensor's float8 copy with tensorwise dynamic scaling (op strobe::fp8_quantize), the operands of
// a scaled GEMM (at::_scaled_mm): x [rows, cols] fp32, bf16 or fp16; dtype Float8_e4m3fn (max 448) or
// Float8_e5m2 (max 57344). amax = max |x| (fp32, NaN when x holds a NaN), scale = fp8_max / max(amax,
// 1e-12), q = fp32(x) * scale saturated to +-fp8_max and rounded to nearest even; returns q [rows, cols],
// q_t = q transposed [cols, rows] contiguous when `transpose` (else an empty [0] tensor) and scale_inv
// = 1 / scale, a 0-dim fp32 (the dequantization scale: x ~ q * scale_inv). No host sync; the CUDA
// kernels give the CPU implementation's bytes (NaN's sign aside). `amax`: max |x| as its producer
// computed it (a 0-dim fp32 tensor on x's device, e.g. fp8_linear_swiglu's y_amax): the pass over x
// that finds it is skipped, the result is the same. Not differentiable.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> fp8_quantize(const torch::Tensor& x, at::ScalarType dtype,
                                                                     bool transpose = false,
                                                                     const std::optional<torch::Tensor>& amax = std::nullopt);

// y = x weight^T (+ bias) with its three GEMMs in float8 (op strobe::fp8_linear), on at::_scaled_mm
// (cuBLASLt on Hopper; ATen's CPU implementation on the CPU): x [..., K] and weight [N, K] (fp32,
// bf16 or fp16; K and N multiples of 16), bias [N] or none; y [..., N] in x's dtype. x and weight
// are quantized to e4m3, the output gradient to e5m2, each with one dynamic scale (fp8_quantize), and
// every GEMM accumulates in fp32 (the forward with fast accumulation). Differentiable: the forward
// keeps only the float8 transposes the backward's GEMMs read (x^T padded to 16 tokens, for d weight,
// when the weight needs a gradient; weight^T, for d x, when x does). No host sync. `x_amax`: max |x|
// from x's producer (fp8_quantize's amax). docs/OPS.md.
torch::Tensor fp8_linear(const torch::Tensor& x, const torch::Tensor& weight,
                         const std::optional<torch::Tensor>& bias = std::nullopt,
                         const std::optional<torch::Tensor>& x_amax = std::nullopt);

// swiglu(fp8_linear(x, weight)) with the float8 casts' amax passes folded into swiglu's kernels (op
// strobe::fp8_linear_swiglu): weight [2 x F, K] holds the gate rows then the up rows; returns y [..., F]
// and y_amax = max |y| (0-dim fp32, not differentiable), which the float8 linear reading y takes as its
// x_amax. In the backward, swiglu's kernel finds the amax of d gate_up as it writes it, so the GEMMs'
// e5m2 cast reads it once. The same values as fp8_linear then swiglu, bit for bit. docs/OPS.md.
// x_amax: max |x| from x's producer (add_rms_norm_amax's y_amax), as fp8_linear's.
std::tuple<torch::Tensor, torch::Tensor> fp8_linear_swiglu(const torch::Tensor& x, const torch::Tensor& weight,
                                                           const std::optional<torch::Tensor>& x_amax = std::nullopt);

// The LM head and its cross-entropy in one op that never materialises the [N, V] logits (op
// strobe::linear_cross_entropy): the mean over tokens whose target is not ignore_index of
// logsumexp(z) - z[target], z = hidden @ weight^T (+ bias) computed in hidden's dtype as the unfused
// head computes it, the loss in fp32 (fp64 for fp64). hidden [N, C] and weight [V, C] share a dtype;
// target int64 [N]. Works chunk by chunk over the tokens (chunk_rows; 0: a chunk's logits near 512
// MiB on CUDA, where one kernel per chunk computes the loss and softmax - onehot in place, near 256
// MiB of fp32 on the CPU) and computes the gradients in the forward (softmax - onehot scaled by
// 1 / valid tokens, a device scalar: no host read, CUDA-graph safe); the backward only scales them by
// the incoming gradient. d weight is accumulated in fp32 (V x C x 4 bytes: 0.98 GiB for
// Llama-3.2-1B's head) and cast to weight's dtype at the end of the forward. A tied head passes the
// embedding's own weight, so its gradient reaches the embedding once. No tokens valid: NaN, as
// PyTorch (zero gradients). docs/OPS.md.
torch::Tensor linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                   const std::optional<torch::Tensor>& bias, const torch::Tensor& target,
                                   int64_t ignore_index = -100, int64_t chunk_rows = 0);

// Softmax cross-entropy (op strobe::cross_entropy) over logits [N, V] (fp32/bf16/fp16; fp64 on CPU)
// and int64 targets [N]: per row logsumexp(logits) - logits[target], rows with target ==
// ignore_index count 0 and are left out of the mean (mean of zero rows: NaN, as PyTorch).
// reduction mean | sum | none ([N]). The loss is fp32 (fp64 for fp64 logits); the gradient has the
// logits' dtype. A target outside [0, V) is an error on CPU and gives a NaN loss / gradient on
// CUDA (no device assert, no silent pass). No label smoothing, no class weights.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, int64_t ignore_index = -100,
                            std::string_view reduction = "mean");

// The transformer MLP y = fc2(gelu_tanh(fc1(x))) as one op (strobe::fused_mlp): x [..., C],
// w1 [H, C], b1 [H], w2 [N, H], b2 [N], all one dtype and device; y [..., N]. GELU is the tanh
// approximation. CUDA (bf16/fp16/fp32, C, H, N multiples of 8): fc1 with cuBLASLt's GELU_AUX_BIAS
// epilogue, and in backward the fc2 data-gradient GEMM with DGELU_BGRAD (d pre-activation and fc1's
// bias gradient in one GEMM); a shape or dtype cuBLASLt refuses is an error, never a silent
// fallback. CPU and Meta: ATen in fp32 (fp64 for fp64), the reference. Differentiable in all five.
torch::Tensor fused_mlp(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1,
                        const torch::Tensor& w2, const torch::Tensor& b2);

// Whether the library was built with its CUDA kernels.
bool built_with_cuda();

}  // namespace strobe::ops
