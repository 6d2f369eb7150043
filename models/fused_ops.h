// The `fused_ops` model key of vit and decoder_lm (docs/CONFIG.md): whether the transformer blocks
// run Strobe's fused kernels (strobe::add_layer_norm: the residual add fused with the next
// LayerNorm, forward and backward) or ATen's separate add and LayerNorm. Parameters and state-dict
// names are the same either way, so checkpoints load across settings.
#pragma once

#include <string>

#include <torch/types.h>

#include "framework/ops/ops.h"

namespace strobe::models {

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

}  // namespace strobe::models
