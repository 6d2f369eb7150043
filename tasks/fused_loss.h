// The tasks' `fused_loss` key (auto | true | false): whether cross-entropy runs as strobe::cross_entropy
// (one kernel each way over the logits in their own dtype, fp32 loss) or as ATen's on an fp32 copy.
#pragma once

#include <string>

#include <torch/types.h>

#include "strobe/ops/ops.h"

namespace strobe {

// auto = on CUDA logits (not fp64) when the ops have their CUDA kernels; true = always (the op's
// ATen kernel on CPU; on CUDA without the kernels a clear error naming the task); false = ATen.
inline bool use_fused_cross_entropy(const std::string& mode, const torch::Tensor& logits, const char* task) {
  if (mode == "false") return false;
  if (mode == "true") {
    TORCH_CHECK(!logits.is_cuda() || ops::built_with_cuda(), task,
                ": fused_loss: true needs the CUDA kernels, but strobe_ops was built without CUDA");
    return true;
  }
  return logits.is_cuda() && ops::built_with_cuda() && logits.scalar_type() != torch::kDouble;
}

}  // namespace strobe
