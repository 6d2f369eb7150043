// StepPipeline: the device-side sequence of one optimizer step (docs/ARCHITECTURE.md, "The step path").
//
//   begin_step()          first micro-batch of a step: snapshot buffers when a guard wants them
//   prepare_backward(l)   per micro-batch: l / accumulate * loss scale; the loss check (device flag)
//   -- backward(), on_after_backward, on_before_optimizer_step (callbacks may still edit grads) --
//   step()                one pass over the gradient list (per-parameter L2 norms) gives the
//                         non-finite flag and the clipping norm; unscale x clip coefficient become
//                         the optimizer's gradient multiplier; one combined skip flag decides the
//                         update; the loss scaler is updated; a skipped step restores buffers.
//
// Contract:
// - No host read anywhere on the fused path (our multi-tensor optimizers take the skip flag and the
//   multiplier as device scalars). torch::optim (CPU, `fused: false`, non-fp32 parameters) cannot
//   skip on the device: when a skip is possible (loss scaling, an armed guard) step() reads the skip
//   flag on the host — one sync per step, documented in docs/ARCHITECTURE.md.
// - Nothing is computed that nobody asked for: without clipping, loss scaling or an armed guard,
//   step() is exactly optimizer.step().
// - Sticky guard (NaN capture, action stop): once a step is non-finite, every later update is
//   skipped too until reset_sticky(), so the weights and optimizer state a capture writes a few steps
//   later are still those from before the failing step.
// - Host-side counters (global step, scheduler) advance on a skipped step, as PyTorch and Lightning do
//   when the loss scaler skips: the host learns of a skip only later. A NaN capture saves the loop
//   state of the failing step itself.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "strobe/checkpoint/stateful.h"
#include "strobe/config/experiment.h"
#include "strobe/core/step_record.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace strobe {

class GradScaler;
class MasterWeights;
namespace distributed {
class Strategy;
class Zero2Shards;
}

// The engine's object (not installed); callbacks read it through StepPipelineView (step_record.h).
class StepPipeline : public Stateful, public StepPipelineView {
 public:
  // The optimizer must hold `net`'s parameters; our fused optimizers are detected and skip on the device.
  // `masters` (precision bf16-master): the optimizer holds fp32 masters of net's bf16 parameters.
  StepPipeline(const config::TrainerConfig& cfg, torch::nn::Module& net, torch::optim::Optimizer& optimizer,
               GradScaler* scaler, MasterWeights* masters = nullptr);
  ~StepPipeline();

  void arm(const StepGuard& guard);
  const StepGuard& guard() const { return guard_; }
  // Data parallel: merges a flag computed from rank-local values (the loss check) across ranks,
  // in place on the device (Strategy::reduce_max), so every rank takes the same skip decision.
  // Gradient flags need none: the gradients are already reduced. The record keeps the local flag.
  // `strategy` outlives the pipeline; null (the default): one process.
  void set_strategy(distributed::Strategy* strategy) { strategy_ = strategy; }
  // trainer.strategy zero2 (after set_strategy): the gradients are the shards' (zero2.h), the
  // per-parameter norms are all-reduced from the shards' squared norms (so the flag, clipping and
  // the record see every parameter's global norm), and the updated shards are all-gathered into
  // the parameters after the update.
  void set_sharded(distributed::Zero2Shards* shards);

  void begin_step();
  torch::Tensor prepare_backward(const torch::Tensor& loss);
  void step();

  const StepRecord& last() const override { return last_; }
  // CUDA graphs: a replay of a captured step() ran. `captured` is the record last() held right after
  // that capture (its tensors are the graph's, overwritten by every replay); last() becomes a copy.
  void step_replayed(const StepRecord& captured) { last_ = clone_record(captured); }
  // 0-d float32 device flag (1 = every update is skipped) of the sticky guard.
  const torch::Tensor& sticky_flag() const { return sticky_; }
  // Stateful (the checkpoint's `step_guard` entry): the sticky skip flag, saved for diagnosis (a
  // checkpoint written after a NaN was detected shows 1; at a step's start 0) but never restored: a
  // resumed run starts with a clear guard, from the pre-corruption weights. The spike window, its
  // position, count and the consecutive-spike counter are restored (exact resume); a checkpoint
  // without them, or with another window size, starts the window anew (said on stderr).
  void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
  void load(const checkpoint::CheckpointData& in) override;
  void reset_sticky();

  // The buffers in snapshot order, and a snapshot unflattened into tensors of their shapes.
  const std::vector<torch::Tensor>& buffers() const { return buffers_; }
  const std::vector<std::string>& buffer_names() const override { return buffer_names_; }
  std::vector<torch::Tensor> unflatten_buffers(const std::vector<torch::Tensor>& flat) const override;
  bool fused() const { return fused_; }

 private:
  // step()'s parts, in order.
  struct GradPass {
    torch::Tensor nonfinite;   // 0-d float32: a gradient holds a NaN or an Inf
    torch::Tensor total_norm;  // the gradients' L2 norm (when clipping by norm or watching spikes)
  };
  GradPass grad_pass(const std::vector<torch::Tensor>& grads, const std::vector<size_t>& with_grad, bool total);
  torch::Tensor nonfinite_verdict(const torch::Tensor& grad_flag);
  torch::Tensor spike_values(const torch::Tensor& total_norm);
  torch::Tensor gradient_multiplier(std::vector<torch::Tensor>& grads, const torch::Tensor& total_norm);
  void apply(std::vector<torch::Tensor>& grads, const torch::Tensor& skip, const torch::Tensor& multiplier);
  std::vector<torch::Tensor> snapshot_buffers() const;
  void init_spike_state();
  // The spike verdict of this step from its metric values [2] (loss, grad norm); fills the record.
  torch::Tensor spike_verdict(const torch::Tensor& values);
  void accept_spike_values(const torch::Tensor& values, const torch::Tensor& skip);
  void restore_buffers(const std::vector<torch::Tensor>& flat, const torch::Tensor& skip);

  const config::TrainerConfig& cfg_;
  torch::optim::Optimizer& optimizer_;
  GradScaler* scaler_;
  MasterWeights* masters_;
  bool fused_;
  StepGuard guard_;
  std::vector<torch::Tensor> params_;
  std::vector<std::string> param_names_;
  std::vector<torch::Tensor> buffers_;
  std::vector<std::string> buffer_names_;
  std::vector<std::vector<size_t>> buffer_groups_;  // indices of buffers per dtype, in snapshot order
  torch::Tensor sticky_;
  torch::Tensor loss_flag_;
  StepRecord current_, last_;
  std::shared_ptr<const std::vector<std::string>> grad_names_;
  distributed::Strategy* strategy_ = nullptr;
  distributed::Zero2Shards* shards_ = nullptr;
  // Spike window state (device): values [2, window] (loss, grad norm), accepted count (capped at
  // the window, float32), write position (int64), consecutive spikes (float32); constants: which
  // metrics are used [2] and positions [window].
  torch::Tensor spike_window_, spike_count_, spike_pos_, spike_consecutive_, spike_used_, spike_positions_;
  std::map<std::string, torch::Tensor> spike_loaded_;  // from a checkpoint, applied once armed
};

}  // namespace strobe
