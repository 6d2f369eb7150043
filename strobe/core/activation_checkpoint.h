// Activation checkpointing: a block's activations are not kept for backward but recomputed there.
//
// checkpoint_block() runs a block's forward without recording the autograd graph (one custom
// autograd node stands for the whole block, holding only the block's inputs); backward runs the
// block again with gradients and takes the gradients of its inputs and parameters through the
// recomputed graph with torch::autograd::grad, which that node returns to the engine as its own (the
// parameters' gradients then reach their accumulators, and the hooks data parallelism installs there,
// exactly as without checkpointing). The recompute sees what the forward saw: the autocast state of
// the forward (CPU and CUDA), the random number generators' states when `preserve_rng` (dropout draws
// the same mask), and the block's buffers as the forward left them (BatchNorm's running statistics
// are updated once per forward, not twice). The same ops run in the same order, so the gradients are
// bitwise those of the block run without checkpointing (tests/models/activation_checkpoint_test.cpp).
//
// The models' key `activation_checkpointing: none | blocks | every_k` (with
// `activation_checkpointing_every: k`, block i checkpointed when i % k == 0) is read by
// ActivationCheckpointing::read; docs/MODELS.md lists the models that take it.
#pragma once

#include <functional>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "strobe/config/config.h"

namespace strobe {

struct ActivationCheckpointing {
  enum class Mode { kNone, kBlocks, kEveryK };
  Mode mode = Mode::kNone;
  int64_t every = 2;  // kEveryK: blocks 0, k, 2k, ... are checkpointed

  bool enabled() const { return mode != Mode::kNone; }
  bool applies(int64_t block) const {
    return mode == Mode::kBlocks || (mode == Mode::kEveryK && block % every == 0);
  }
  // Reads `activation_checkpointing` and `activation_checkpointing_every` from a model's section.
  static ActivationCheckpointing read(config::Section& cfg);
};

using BlockFunction = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

// fn(inputs) for `block` (the module whose parameters and buffers fn uses; its parameters receive
// their gradients through the checkpoint). Without gradient mode, or when no input and no parameter
// of `block` requires a gradient, fn runs as it is. Inputs may be undefined tensors. Tensors fn uses
// but does not take as inputs (rotary tables, masks) must not require gradients: they get none.
// `preserve_rng`: the CPU generator's state and that of the CUDA device the inputs are on are saved
// before the forward and restored around the recompute (PyTorch's checkpoint does the same); a block
// that draws no random numbers passes false. Under CUDA graph capture the CUDA generator's state
// cannot be read, so a block with preserve_rng true cannot be captured (one clear error).
std::vector<torch::Tensor> checkpoint_block(torch::nn::Module& block, const std::vector<torch::Tensor>& inputs,
                                            const BlockFunction& fn, bool preserve_rng = true);

// Block `index` of a model's block list, as the models run each block: checkpointed when `ac`
// applies to it, and under trainer.strategy fsdp inside the block's unit when it has one
// (strobe/distributed/fsdp.h: the unit outside, the checkpoint inside: gather, forward, free; in
// the backward gather, recompute, gradients, free).
std::vector<torch::Tensor> run_model_block(const ActivationCheckpointing& ac, int64_t index, torch::nn::Module& block,
                                           const std::vector<torch::Tensor>& inputs, const BlockFunction& fn,
                                           bool preserve_rng);
// Whether `block` has a unit of trainer.strategy fsdp (run_model_block runs it there).
bool runs_in_unit(const torch::nn::Module& block);
// fn(x) inside `module`'s unit of trainer.strategy fsdp when it has one (an untied embedding or
// head: gathered around fn, as run_model_block's blocks), else fn(x). fn uses `module`'s parameters
// and x (which may need no gradient: token ids).
torch::Tensor run_in_unit(torch::nn::Module& module, const torch::Tensor& x,
                          const std::function<torch::Tensor(const torch::Tensor&)>& fn);

}  // namespace strobe
