// TrainerView: what a callback sees of the trainer. Callbacks (callbacks/, and a user's own) compile
// against this header and never trainer.h; each member's contract is its one-line comment. The
// Trainer implements it; a test can implement it with a fake.
//
// StepAccess: the narrow interface of a callback that guards the optimizer step (NaN capture) or
// checkpoints a step's start (on_exception_checkpoint): the step guard, the step pipeline's record
// and buffers, and a checkpoint of a step's start. It is
// reached through TrainerView::step_access(); a callback that only observes needs none of it.
//
// Room left, not built yet: an evaluation run under a metric prefix joins as a member here or an
// interface of its own like StepAccess; nothing below assumes it cannot.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "strobe/config/experiment.h"
#include "strobe/core/loop_state.h"

namespace torch::optim {
class Optimizer;
}

namespace strobe {

class DataModule;
class LRScheduler;
class StepPipelineView;
struct StepGuard;
namespace checkpoint {
struct CheckpointData;
}

// Under trainer.strategy fsdp a parameter holds no values between steps: TrainerView::weights()
// then gives this rank's rows of each parameter (the optimizer's fp32 shards), and this turns a
// tensor of those rows whole and back (a weight average kept per shard: the ema and swa callbacks).
// Index i is weights()' i; its floating buffers are whole on every rank (whole() and rows_of()
// return them as they are).
class ShardedWeights {
 public:
  virtual ~ShardedWeights() = default;
  // Collective (every rank, the same indices in the same order): the whole tensor of weight i
  // whose rows on this rank are `rows` (shaped as weights()[i]).
  virtual torch::Tensor whole(size_t i, const torch::Tensor& rows) = 0;
  // This rank's rows of weight i's whole tensor `whole` (shaped as weights()[i]).
  virtual torch::Tensor rows_of(size_t i, const torch::Tensor& whole) = 0;
  // The shape of weight i's whole tensor.
  virtual std::vector<int64_t> whole_shape(size_t i) = 0;
  // Collective: after weights()' rows were written, the model's forward uses them (the units kept
  // gathered gather again; the others gather from the rows at their next forward anyway).
  virtual void changed() = 0;
};

class StepAccess {
 public:
  // ORs `guard` into the step guard (non-finite checks, sticky skip, buffer snapshots); callable in
  // setup, before the step pipeline exists, and later (it applies from the next step).
  virtual void arm_step_guard(const StepGuard& guard) = 0;
  // The step pipeline, from on_fit_start on: the latest step's record (device flags, losses, gradient
  // norms, buffer snapshots) and the buffers' names in snapshot order.
  virtual const StepPipelineView& step_pipeline() const = 0;
  // A checkpoint whose loop counters, generators and named buffers are `start`'s (loop_state.h,
  // StepStart) and whose weights, optimizer and callbacks' state are the live ones; same keys as any.
  virtual checkpoint::CheckpointData make_checkpoint_at(const StepStart& start) = 0;

 protected:
  ~StepAccess() = default;
};

class TrainerView {
 public:
  // --- the run ---
  // The trainer: section as resolved (precision, log_every_n_steps, limits, checkpointing switches).
  virtual const config::TrainerConfig& config() const = 0;
  // The run directory ("" when the run writes no files: tests, fast_dev_run without one).
  virtual const std::string& run_dir() const = 0;
  // The device the model and every batch live on.
  virtual const torch::Device& device() const = 0;

  // --- counters (host values, never a device read) ---
  // Epoch, global step, batch in epoch, batches seen, validation runs (loop_state.h).
  virtual const TrainerState& state() const = 0;
  // Micro-batches already run in the current optimizer step (0 at a step boundary).
  virtual int64_t accumulated_batches() const = 0;
  // Training batches per epoch after the limits (limit_train_batches, overfit_batches, fast_dev_run).
  virtual int64_t num_training_batches() const = 0;
  // Optimizer steps the whole fit will take under its limits (schedulers size themselves by it).
  virtual int64_t estimated_stepping_batches() const = 0;
  // True while the sanity validation before training runs (its metrics decide nothing).
  virtual bool sanity_checking() const = 0;
  // Host seconds the training loop waited for the loader's current batch (read in on_train_batch_start).
  virtual double last_input_wait_s() const = 0;

  // --- processes (data parallel; one process: rank 0 of 1) ---
  virtual bool is_global_zero() const = 0;  // rank 0: the one that writes run files and prints
  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  // Rank 0's value on every rank; a collective: every rank calls it at the same point.
  virtual std::optional<double> rank0_value(std::optional<double> value) = 0;

  // --- metrics and logging ---
  // Host values of the latest delivered metrics, by name (never forces a sync).
  virtual const std::map<std::string, double>& metrics() const = 0;
  // The global step of the row metrics()'s value of `name` came in (a value reaches the host every
  // log_every_n_steps, so it can be older than state().global_step); nullopt for a name not there.
  virtual std::optional<int64_t> metric_step(const std::string& name) const = 0;
  // Waits for every pending metric copy (epoch-end decisions and checkpoints only).
  virtual void drain_metrics() = 0;
  // Host values for the current step's row, delivered to the loggers at once.
  virtual void log_host(const std::vector<std::pair<std::string, double>>& values) = 0;
  // The same for a given step's row (a callback that learns of a step's outcome later).
  virtual void log_host_at(int64_t step, int64_t epoch, const std::vector<std::pair<std::string, double>>& values) = 0;

  // --- what trains ---
  // The optimizer (null before fit's setup); read its groups' learning rates, never step it.
  virtual torch::optim::Optimizer* optimizer() = 0;
  // The names of the optimizer's parameter groups, in its order ("default", "default/no_decay",
  // "groups[0]", ...: optimizer.param_groups); empty before fit's setup or for a task's own optimizer.
  virtual const std::vector<std::string>& param_group_names() const = 0;
  // The model's parameters and floating buffers by name, as checkpoints hold them (bf16-master: the
  // fp32 masters under the parameters' names; under trainer.strategy zero2, whose fp32 values are
  // sharded, the trained bf16 parameters; under fsdp this rank's rows of the fp32 values: see
  // sharded_weights()): the live tensors, to read (the ema callback averages them), never to write
  // (but through ShardedWeights' contract).
  virtual std::vector<std::pair<std::string, torch::Tensor>> weights() = 0;
  // Non-null under trainer.strategy fsdp with several processes: weights() holds rows, turned whole
  // and back by this.
  virtual ShardedWeights* sharded_weights() { return nullptr; }
  // The learning-rate scheduler (null when there is none).
  virtual LRScheduler* scheduler() = 0;
  // The data: its loaders and their options.
  virtual DataModule& datamodule() = 0;
  // The model's forward, in its current mode and precision, without gradients, over one epoch
  // (`epoch`'s order) of the training data as this rank trains on it (the run's limits and
  // data.exclude applied): what recomputing BatchNorm statistics needs (the swa callback). Logs
  // nothing and calls no hook; the training loader is left stopped. Returns the batches run.
  virtual int64_t forward_over_training_data(int64_t epoch) = 0;

  // --- control ---
  // Ends training after the current step (on every rank); `exit_code` becomes fit()'s status.
  virtual void request_stop(int exit_code = kExitOk) = 0;
  virtual bool should_stop() const = 0;
  // Writes a checkpoint of the live state to `path` atomically. A collective under data parallel
  // (the generators are gathered): every rank calls it at the same point; rank 0 writes.
  virtual void save_checkpoint(const std::string& path) = 0;
  // The live state as a checkpoint, in memory (a collective like save_checkpoint).
  virtual checkpoint::CheckpointData make_checkpoint() = 0;

  // --- narrow interfaces ---
  virtual StepAccess& step_access() = 0;

 protected:
  ~TrainerView() = default;
};

}  // namespace strobe
