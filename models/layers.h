// Small layer helpers shared by the built-in models.
#pragma once

#include <functional>
#include <utility>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include "strobe/core/activation_checkpoint.h"
#include "strobe/core/fp8.h"

namespace strobe::models {

// y = x W^T + b for an nn::Linear (strobe/core/fp8.h): float8 GEMMs for a layer trainer.fp8 marked,
// at::linear otherwise. Not nn::Linear's own forward (torch::nn::functional::linear in the C++
// frontend), which runs `matmul` and then a broadcast `output += bias` whenever x has more than 2
// dims: one more strided pass over every output (a legacy TensorIterator kernel: 15.6 ms of a ViT-L
// step and 19.5 ms of a padded LM step on an H200, bench/e2e/profile_gpu.sh). at::linear folds a
// contiguous [..., C] input into one addmm whose bias add happens in the GEMM's epilogue. Same
// parameters, same checkpoint names.
using strobe::linear;

// Block `index` of a model's block list, checkpointed when `ac` applies to it
// (strobe/core/activation_checkpoint.h). `fn` runs the block; it is kept until backward recomputes
// the block, so it captures by value (a reference to the caller's locals would dangle). No built-in
// block draws random numbers: their RNG state is not kept.
// Under trainer.strategy fsdp the block runs inside its unit (run_model_block).
inline at::Tensor run_block(const ActivationCheckpointing& ac, int64_t index, torch::nn::Module& block,
                            const at::Tensor& x, std::function<at::Tensor(const at::Tensor&)> fn) {
  if (!ac.applies(index) && !runs_in_unit(block)) return fn(x);
  return run_model_block(ac, index, block, {x}, [fn = std::move(fn)](const std::vector<at::Tensor>& t) {
    return std::vector<at::Tensor>{fn(t[0])};
  }, /*preserve_rng=*/false)[0];
}

// The fused paths' blocks: the residual stream arrives and leaves as (res, pending), the stream
// being res + pending; fn(res, undefined) takes res as the whole stream (the first block). A
// checkpointed block keeps one tensor, not two: res + pending is added before it and the block
// starts from the sum as the first block does (a plain RMSNorm or LayerNorm instead of the fused
// add and norm: the same forward values, as both round the sum to its dtype before normalising).
// At 8 x 2048 tokens of width 4096 in bf16 that is 128 MiB less a checkpointed block.
using FusedBlockFn = std::function<std::pair<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&)>;
inline std::pair<at::Tensor, at::Tensor> run_block(const ActivationCheckpointing& ac, int64_t index,
                                                   torch::nn::Module& block, const at::Tensor& res,
                                                   const at::Tensor& pending, FusedBlockFn fn) {
  if (!ac.applies(index) && !runs_in_unit(block)) return fn(res, pending);
  std::vector<at::Tensor> inputs{res, pending};
  if (ac.applies(index) && pending.defined() && at::GradMode::is_enabled()) inputs = {res + pending, at::Tensor()};
  auto out = run_model_block(ac, index, block, inputs, [fn = std::move(fn)](const std::vector<at::Tensor>& t) {
    auto [r, p] = fn(t[0], t[1]);
    return std::vector<at::Tensor>{r, p};
  }, /*preserve_rng=*/false);
  return {out[0], out[1]};
}

}  // namespace strobe::models
