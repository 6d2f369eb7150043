// Fused multi-tensor optimizers with a device-side NaN guard.
//
// Contract: drop-in torch::optim::Optimizer subclasses taking torch::optim's option types, so an
// LR scheduler sets lr per param group as usual and Optimizer::save/load write the same archive
// layout as torch::optim::AdamW/Adam/SGD (a checkpoint of either loads into the other; the step
// count is saved as an int64 like torch::optim's). On CUDA, step() updates all parameters of a
// group in one kernel (+ one tiny step-count kernel) without syncing the host; params must be
// contiguous fp32 (master weights), grads fp32/bf16/fp16. On CPU the same math runs as ATen ops.
//
// set_found_nonfinite(flag) arms the guard for the next step() only: when the 0-dim flag (e.g.
// from strobe::ops::nonfinite_check) is nonzero on the device, weights, moments and step counts
// stay untouched. set_grad_multiplier(m) likewise multiplies the next step's gradients by a 0-dim
// device scalar (AMP unscale and/or clip coefficient) inside the same kernel.
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

namespace strobe::ops {

// Per-parameter state; `step` is a 0-dim fp32 tensor on the parameter's device.
struct FusedAdamParamState : torch::optim::OptimizerCloneableParamState<FusedAdamParamState> {
  TORCH_ARG(torch::Tensor, step);
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);
  TORCH_ARG(torch::Tensor, max_exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

struct FusedSGDParamState : torch::optim::OptimizerCloneableParamState<FusedSGDParamState> {
  TORCH_ARG(torch::Tensor, step);
  TORCH_ARG(torch::Tensor, momentum_buffer);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

// Shared guard plumbing (one-shot flag and multiplier).
class FusedOptimizerBase : public torch::optim::Optimizer {
 public:
  using torch::optim::Optimizer::Optimizer;
  void set_found_nonfinite(torch::Tensor flag) { found_nonfinite_ = std::move(flag); }
  void set_grad_multiplier(torch::Tensor multiplier) { grad_multiplier_ = std::move(multiplier); }

  // CUDA graphs: with the device lr on, step() reads each group's learning rate from a 0-dim
  // float64 tensor beside its parameters instead of passing the host value as a kernel argument
  // (which a captured graph would replay frozen). sync_device_lr() copies the groups' current lrs
  // (as the scheduler set them) into those tensors: call it before each replay, outside the
  // captured region (one fill kernel per group, no host sync).
  void enable_device_lr();
  void sync_device_lr();
  bool device_lr_enabled() const { return !device_lrs_.empty(); }
  // The group's lr tensor, or undefined when the device lr is off.
  torch::Tensor lr_tensor(size_t group) const {
    return group < device_lrs_.size() ? device_lrs_[group] : torch::Tensor();
  }

 protected:
  // Takes (and clears) the armed flag and multiplier.
  std::pair<torch::Tensor, torch::Tensor> take_guards();

 private:
  std::vector<torch::Tensor> device_lrs_;
  torch::Tensor found_nonfinite_;
  torch::Tensor grad_multiplier_;
};

// Adam and AdamW: one class over torch::optim's option type, which decides the weight decay
// (AdamWOptions: decoupled, p *= 1 - lr * wd; AdamOptions: L2, grad += wd * p) and the archive's
// option layout.
template <typename Options>
class FusedAdamFamily : public FusedOptimizerBase {
 public:
  explicit FusedAdamFamily(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults = {});
  explicit FusedAdamFamily(std::vector<torch::Tensor> params, Options defaults = {})
      : FusedAdamFamily({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};
using FusedAdamW = FusedAdamFamily<torch::optim::AdamWOptions>;
using FusedAdam = FusedAdamFamily<torch::optim::AdamOptions>;
extern template class FusedAdamFamily<torch::optim::AdamWOptions>;
extern template class FusedAdamFamily<torch::optim::AdamOptions>;

class FusedSGD : public FusedOptimizerBase {
 public:
  explicit FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                    torch::optim::SGDOptions defaults);
  explicit FusedSGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions defaults)
      : FusedSGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

}  // namespace strobe::ops
