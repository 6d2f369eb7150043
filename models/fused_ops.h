// The `fused_ops` model key of vit and decoder_lm (docs/CONFIG.md): whether the transformer blocks
// run Strobe's fused kernels (strobe::add_layer_norm: the residual add fused with the next
// LayerNorm, forward and backward) or ATen's separate add and LayerNorm. Parameters and state-dict
// names are the same either way, so checkpoints load across settings.
#pragma once

#include <string>

#include <ATen/autocast_mode.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include "strobe/ops/ops.h"
#include "models/layers.h"

namespace strobe::models {

// auto | true | false, parsed once; resnet's `fused_bn` key takes the same three values.
enum class FusedOps { kAuto, kOn, kOff };

inline FusedOps parse_fused_ops(const std::string& s) {
  return s == "true" ? FusedOps::kOn : s == "false" ? FusedOps::kOff : FusedOps::kAuto;
}

// auto: the kernels when the activations are on CUDA in fp32/bf16/fp16 with at most 4096 features
// and the ops were built with CUDA; true: always the strobe ops (on CPU their ATen reference
// kernels; on CUDA without built kernels a clear error); false: ATen.
inline bool use_fused_ops(FusedOps mode, const torch::Tensor& x, const char* model) {
  if (mode == FusedOps::kOff) return false;
  if (mode == FusedOps::kOn) {
    TORCH_CHECK(!x.is_cuda() || ops::built_with_cuda(), model,
                ": fused_ops: true needs the CUDA kernels, but strobe_ops was built without CUDA; set "
                "model.fused_ops: auto or false");
    return true;
  }
  return x.is_cuda() && ops::built_with_cuda() && x.size(-1) <= 4096 && x.scalar_type() != torch::kDouble;
}

// The `custom_pool` key of resnet and face_detector (same three values): whether their max-pools run
// as strobe::max_pool2d (one-byte argmax, gather backward) or ATen's. auto: the op where its CUDA
// kernels take x as it is (ops::max_pool2d_cuda_eligible), ATen elsewhere; true: always the op (its
// CPU kernel on CPU; on CUDA a tensor the kernels cannot take is an error saying why); false: ATen.
inline bool use_custom_pool(FusedOps mode, const torch::Tensor& x, const char* model) {
  if (mode == FusedOps::kOff) return false;
  const bool eligible = ops::max_pool2d_cuda_eligible(x);
  if (mode == FusedOps::kOn) {
    TORCH_CHECK(!x.is_cuda() || eligible, model, ": custom_pool: true needs ",
                ops::built_with_cuda() ? "a float32/bfloat16/float16 activation, contiguous or channels_last, got "
                                       : "the CUDA kernels, but strobe_ops was built without CUDA; got ",
                x.scalar_type(), " ", x.sizes(), "; set model.custom_pool: auto or false");
    return true;
  }
  return eligible;
}

// (x + delta, LayerNorm(x + delta)) through strobe::add_layer_norm. The two take their promoted
// dtype first, as ATen's `x + delta` does: under autocast (bf16-mixed) the residual stream is fp32
// while the projections return bf16.
// y_amax: when not null, the norm's output amax too (strobe::add_layer_norm_amax), for the float8
// linear layers that read it (trainer.fp8).
inline std::tuple<torch::Tensor, torch::Tensor> residual_layer_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                                    const torch::Tensor& weight,
                                                                    const std::optional<torch::Tensor>& bias, double eps,
                                                                    std::optional<torch::Tensor>* y_amax = nullptr) {
  const auto dt = at::promote_types(x.scalar_type(), delta.scalar_type());
  if (y_amax == nullptr) return ops::add_layer_norm(x.to(dt), delta.to(dt), weight, bias, eps);
  auto [sum, y, amax] = ops::add_layer_norm_amax(x.to(dt), delta.to(dt), weight, bias, eps);
  *y_amax = amax;
  return {sum, y};
}

// The MLP fc2(gelu(fc1(h))) of vit / decoder_lm. `gelu: tanh` makes the model's GELU the tanh
// approximation on every path (so CPU and GPU runs of one config are the same model); with the fused
// ops on it then runs as strobe::fused_mlp (cuBLASLt GELU epilogues on CUDA, the ATen reference on
// CPU). fused_ops: true with an MLP the op cannot take (dtypes differ from the weights', e.g. under
// autocast) is an error; auto uses the separate ATen ops then. A layer trainer.fp8 marked runs its
// GEMM in float8 (strobe::linear) and the GELU apart.
// h_amax: max |h| from the norm that wrote h, for fc1 in float8.
inline torch::Tensor transformer_mlp(const torch::Tensor& h, torch::nn::Linear& fc1, torch::nn::Linear& fc2,
                                     bool gelu_tanh, bool fused, FusedOps mode,
                                     const std::optional<torch::Tensor>& h_amax = std::nullopt) {
  if (fused && gelu_tanh && !fp8_marked(*fc1) && !fp8_marked(*fc2)) {
    const bool same_dtype = h.scalar_type() == fc1->weight.scalar_type() && h.scalar_type() == fc2->weight.scalar_type();
    const bool autocast = h.is_cuda() && at::autocast::is_autocast_enabled(at::kCUDA);
    if (same_dtype && !autocast) return ops::fused_mlp(h, fc1->weight, fc1->bias, fc2->weight, fc2->bias);
    TORCH_CHECK(mode != FusedOps::kOn, "fused_ops: true: strobe::fused_mlp needs the activations in the weights' dtype "
                "without autocast (precision bf16-master or 32), got ", h.scalar_type(), " activations, ",
                fc1->weight.scalar_type(), " weights", autocast ? ", autocast on" : "");
  }
  const torch::Tensor a = linear(fc1, h, h_amax);
  return linear(fc2, gelu_tanh ? torch::gelu(a, "tanh") : torch::gelu(a));
}

}  // namespace strobe::models
