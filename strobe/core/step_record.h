// What a callback asks of the optimizer step and reads back from it (docs/ARCHITECTURE.md, "The step
// path"): the guard it arms (StepAccess::arm_step_guard), the device-side record of the latest step,
// and StepPipelineView, the read-only side of the step pipeline (StepAccess::step_pipeline). The
// built-in nan_capture and ema callbacks use exactly this; the pipeline itself is the engine's.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

namespace strobe {

// Loss-spike detection (nan_capture.spike, docs/NAN_CAPTURE.md): a step whose metric exceeds the
// mean + zscore x population std of the last `window` accepted steps' values is a spike. The
// window lives on the device; only accepted steps (applied, finite) enter it.
struct SpikeGuard {
  bool loss = false;       // the step's loss (mean over micro-batches; averaged over ranks)
  bool grad_norm = false;  // the total gradient L2 norm (unscaled under 16-mixed)
  double zscore = 6.0;
  int64_t window = 128;
  int64_t warmup = 64;           // accepted steps in the window before a step can be a spike
  bool stop = true;              // a spike makes the skip flag sticky (false: skip that step only)
  int64_t max_consecutive = 5;   // with !stop: this many spikes in a row become sticky
  bool armed() const { return loss || grad_norm; }
};

// What a callback (NaN capture) asks of the step; arm() ORs requests together.
struct StepGuard {
  bool check_grads = false;       // non-finite gradients make the step non-finite
  bool check_loss = false;        // a non-finite loss of any micro-batch makes the step non-finite
  bool sticky = false;            // a non-finite step skips every later update until reset_sticky()
  bool restore_buffers = false;   // a skipped step leaves buffers (BN statistics) as before it
  bool snapshot_buffers = false;  // keep a copy of the buffers from before each step in the record
  SpikeGuard spike;               // armed: spikes skip the update (the last armed one wins)
  StepGuard& operator|=(const StepGuard& o) {
    check_grads |= o.check_grads, check_loss |= o.check_loss, sticky |= o.sticky;
    restore_buffers |= o.restore_buffers, snapshot_buffers |= o.snapshot_buffers;
    if (o.spike.armed()) spike = o.spike;
    return *this;
  }
};

// The device-side outcome of the latest step; tensors are fresh each step, so a holder can keep
// them (a reference, no copy) after the next step has begun.
struct StepRecord {
  torch::Tensor nonfinite;       // 0-d float32: this step's verdict under the armed checks (1 = bad)
  torch::Tensor loss_nonfinite;  // 0-d float32, defined when the loss is checked
  torch::Tensor grad_nonfinite;  // 0-d float32, defined when the gradients were checked
  torch::Tensor skipped;         // 0-d float32: the update was not applied (undefined: it was)
  torch::Tensor grad_norms;      // [n] per-gradient L2 norms (fp32), aligned with grad_names
  std::shared_ptr<const std::vector<std::string>> grad_names;
  std::vector<torch::Tensor> losses;          // each micro-batch's loss, detached
  std::vector<torch::Tensor> buffers_before;  // with snapshot_buffers: one flat tensor per dtype
  // With a spike guard: `spike` 0-d float32 (1 = this step spiked), `spike_limit` (1 = it made the
  // guard sticky: action stop, or the max_consecutive-th spike in a row), and `spike_stats` [9]:
  // loss value, mean, std; grad-norm value, mean, std (over the window before this step);
  // consecutive spikes; loss over threshold; grad norm over threshold.
  torch::Tensor spike, spike_limit, spike_stats;
};

// Indices into StepRecord::spike_stats.
enum SpikeStat : int64_t { kLossValue, kLossMean, kLossStd, kNormValue, kNormMean, kNormStd, kConsecutive, kLossOver, kNormOver, kSpikeStats };

// A copy of `r` whose tensors are fresh (clones): for a holder that keeps it past the next step.
StepRecord clone_record(const StepRecord& r);

// The step pipeline as a callback sees it, from on_fit_start on.
class StepPipelineView {
 public:
  // The latest step's record (device flags, losses, gradient norms, buffer snapshots).
  virtual const StepRecord& last() const = 0;
  // The model's buffers in snapshot order (StepRecord::buffers_before), and a snapshot unflattened
  // into tensors of their shapes.
  virtual const std::vector<std::string>& buffer_names() const = 0;
  virtual std::vector<torch::Tensor> unflatten_buffers(const std::vector<torch::Tensor>& flat) const = 0;

 protected:
  ~StepPipelineView() = default;
};

}  // namespace strobe
