// The loops, as objects (Lightning's fit_loop and evaluation_loop are the model): each owns its
// counters, limits and hooks; the Trainer builds them and wires them to the step, the data and the
// callbacks (trainer.cpp). Either can be driven on its own: tests/trainer/loops_test.cpp does.
//
// FitLoop: epochs of training batches. It owns the loop counters (TrainerState, the checkpoint's
// `loop` blob), the training limits (limit_train_batches, overfit_batches, fast_dev_run, max_steps,
// max_epochs, max_time), when validation runs, and the stop state (callbacks' requests, signals,
// and under data parallel the stop code agreed across ranks), and the optimizer step's progress: the
// accumulation window, global_step, the scheduler's step and the end of each optimizer step. One
// step's path runs downward: FitLoop::run_batch -> its TrainingRunner (step_runner.h: eager, or the
// graphed one) -> StepRunner -> StepPipeline -> the optimizer. Nothing on that path calls back into
// the Trainer: the loops and runners are handed what they read (the optimizer, the scheduler, the
// counters, whether this is rank 0) when they are built or set up, and they pass the callbacks' view
// on to the hooks without using it (trainer_view.h is not included here or on the step's path).
//
// EvaluationLoop: one validation or test run over its limited batches, in Lightning's hook order,
// with the epoch's metrics waited for once at its end (early stopping, checkpoints and a plateau
// scheduler decide on them). PredictLoop: one prediction run.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "strobe/config/experiment.h"
#include "strobe/core/callback.h"
#include "strobe/core/datamodule.h"
#include "strobe/core/device_transfer.h"
#include "strobe/core/loop_state.h"
#include "strobe/core/module.h"
#include "strobe/checkpoint/stateful.h"
#include "strobe/data/batch.h"
#include "strobe/logging/device_readback.h"

namespace torch::optim {
class Optimizer;
}

namespace strobe {

class Freeze;
class LRScheduler;
class TrainerView;
class TrainingRunner;
namespace logging {
class LogCollector;
}
namespace data {
class DataLoader;
}
namespace distributed {
class Strategy;
}

// A loader's batch onto the device through the data module's hooks: on_before_batch_transfer,
// transfer_batch_to_device (on a copy stream on CUDA: device_transfer.h), on_after_batch_transfer;
// a batch the data module injects (replay) stands in for a training batch.
class BatchPreparer {
 public:
  BatchPreparer(DataModule& datamodule, Module& module, torch::Device device)
      : datamodule_(datamodule), module_(module), device_(device) {}
  Batch prepare(Batch batch, int64_t dataloader_idx);

 private:
  DataModule& datamodule_;
  Module& module_;
  torch::Device device_;
  BatchTransfer transfer_;
};

// What both loops are wired to (the Trainer's parts, which outlive the loops).
struct LoopParts {
  TrainerView* view = nullptr;  // the callbacks' view of the trainer: handed to their hooks, never used here
  Module* module = nullptr;
  DataModule* datamodule = nullptr;
  logging::LogCollector* collector = nullptr;
  const config::TrainerConfig* cfg = nullptr;
  torch::Device device{torch::kCPU};
  const std::vector<std::shared_ptr<Callback>>* callbacks = nullptr;
  BatchPreparer* preparer = nullptr;  // null: batches stay as the loader made them (tests)
  bool global_zero = true;            // this process is rank 0: it prints the loop's notes

  Batch prepare(Batch batch, int64_t dataloader_idx) const {
    return preparer ? preparer->prepare(std::move(batch), dataloader_idx) : batch;
  }

  // `hook` names the hook for a callback that throws what is not a std::exception (call_hook).
  template <class F>
  void each(const char* hook, F&& f) const {
    for (auto& cb : *callbacks) call_hook(*cb, hook, [&] { f(*cb); });
  }
};

class EvaluationLoop {
 public:
  // `state`: the fit loop's counters (the logged step and epoch; validation runs are counted there).
  EvaluationLoop(LoopParts parts, TrainerState& state);

  // The scheduler a validation run feeds its monitored metric (reduce-on-plateau); null: none.
  void set_scheduler(LRScheduler* scheduler) { scheduler_ = scheduler; }

  // One run of `stage` (Validate or Test) over at most `limit` batches (-1: no limit beyond
  // trainer.limit_{val,test}_batches and fast_dev_run). `sanity`: the sanity check before training,
  // whose metrics are discarded and which counts no validation run. Returns the batches run (0: no
  // loader, or a limit of 0, and then no hook ran). The module's train/eval mode is restored.
  int64_t run(Stage stage, int64_t limit, bool sanity);

  // Batches a run of `stage` would take under the limits above (0: no loader), without running it.
  int64_t planned_batches(Stage stage, int64_t limit) const;

 private:
  std::shared_ptr<data::DataLoader> loader_of(Stage stage) const;  // the data module's, or null

  LoopParts parts_;
  TrainerState& state_;
  LRScheduler* scheduler_ = nullptr;
};

// PredictLoop: one prediction run over the data module's predict loader (trainer.limit_predict_batches),
// in Lightning's hook order, without gradients, under the run's precision; returns each batch's
// predict_step output. The module is left in eval mode.
// What a prediction run hands each batch to (strobe predict's writer, runner/predict.h): the batch on
// the device and the host batch's dataset indices, the module's outputs (on the device), and the
// dataset they come from. The sink keeps what it needs, on the host.
class PredictSink {
 public:
  virtual ~PredictSink() = default;
  virtual void consume(const Batch& batch, const std::vector<int64_t>& indices, const torch::Tensor& outputs,
                       const data::Dataset& dataset) = 0;
};

class PredictLoop {
 public:
  explicit PredictLoop(LoopParts parts) : parts_(std::move(parts)) {}
  // The module in evaluation mode over the predict loader (the test set's), or with `split`
  // Validate over the validation set, in dataset order. With a sink each batch goes to it; without,
  // the outputs are returned, moved to the host as they come.
  std::vector<torch::Tensor> run(Stage split = Stage::Predict, PredictSink* sink = nullptr);

 private:
  LoopParts parts_;
};

class FitLoop {
 public:
  // `strategy`: data parallel's stop agreement (one process: no collective is made).
  FitLoop(LoopParts parts, distributed::Strategy& strategy, int64_t world_size);

  // The validation runs' loop (its counters are this loop's state()); without one, never validates.
  void set_evaluation(EvaluationLoop* evaluation) { evaluation_ = evaluation; }
  // Takes the training loader and applies the training limits; throws when it yields no batches.
  void setup(std::shared_ptr<data::DataLoader> loader);
  // A resume in the middle of an epoch whose order this run's data config would change (a mix's
  // sources or weights, the packing plan: docs/DATA.md): the epoch finishes with `loader`, made from
  // `config_yaml` (the config the epoch began under; checkpoints taken before its end record it) and
  // its sources' names; the run's own loader takes over at the next epoch.
  void finish_epoch_with(std::shared_ptr<data::DataLoader> loader, std::string config_yaml, std::vector<std::string> source_names);
  // What runs each training micro-batch (the Trainer's eager or graphed runner, or a test's).
  void set_runner(TrainingRunner* runner) { runner_ = runner; }
  // The optimizer whose step ends each accumulation window (callbacks' on_before_zero_grad gets it)
  // and the scheduler stepped after it; null: none (a test's loop).
  void set_optimizer(torch::optim::Optimizer* optimizer, LRScheduler* scheduler) {
    optimizer_ = optimizer;
    scheduler_ = scheduler;
  }
  // optimizer.param_groups.freeze (freeze.h), brought to the epoch at each epoch's start (after the
  // module is put in training mode) and before each training batch; null: none.
  void set_freeze(Freeze* freeze) { freeze_ = freeze; }

  // --- counters ---
  TrainerState& state() { return state_; }
  const TrainerState& state() const { return state_; }
  // The counters as a checkpoint records them: elapsed_s includes this process's training time.
  TrainerState saved_state() const;
  int64_t num_batches() const { return num_batches_; }  // training batches per epoch, after the limits
  // A resume that changed the batch (data.batch_size x processes): the restored epoch goes on after
  // `consumed` samples of its order (all processes together), cut into the new batches from there;
  // its batch count restarts at 0 (trainer.cpp's check_resume_world_size says when).
  void rebase_to_samples(int64_t consumed) {
    state_.sample_offset = consumed;
    state_.batch_in_epoch = 0;
  }
  // Optimizer steps the fit takes under max_epochs and max_steps (-1: unbounded).
  int64_t estimated_stepping_batches() const;
  double last_input_wait_s() const { return last_input_wait_s_; }
  // One pass of the model's forward in its current mode, without gradients, over `epoch` of the
  // training loader (this rank's batches, the run's limits and exclusions), nothing logged and no
  // hook called (TrainerView::forward_over_training_data). Returns the batches run.
  int64_t forward_over_training_data(int64_t epoch);
  // Micro-batches of the optimizer step in progress run so far (0 between optimizer steps); a
  // checkpoint's `accumulation` blob restores it.
  int64_t accumulated_batches() const { return accum_count_; }
  // The checkpoint's `loop` entry (the counters; at a step's start, that step's; restored for
  // evaluation too, so that its logged step and epoch match) and its `accumulation` entry (the
  // window's micro-batch count and, inside a window, the module's partial gradients).
  Stateful& progress_state() { return progress_; }
  Stateful& accumulation_state() { return accumulation_; }

  // --- running ---
  // max_time (and a checkpoint's elapsed time) counts from here: fit's start, sanity check included.
  void start_clock() { start_time_ = std::chrono::steady_clock::now(); }
  // Epochs until done(): the epoch rollover, then each batch's end in order (on_train_batch_end,
  // the validation it triggers, the epoch's end, on_train_batch_complete: docs/ARCHITECTURE.md).
  void run();
  void run_epoch();
  // One training batch from the loader (`batch_idx` in its epoch): on_train_batch_start, onto the
  // device, the runner's micro-batch and, when it ends the accumulation window (or the epoch), the
  // end of the optimizer step: on_before_zero_grad, the runner's zero_grad, global_step, the
  // scheduler, the step's log row, the stop agreement. Returns the loss (detached). The epoch's
  // counters are run_epoch's: a program may run single batches through this (replay, tests).
  torch::Tensor run_batch(Batch host_batch, int64_t batch_idx);
  // A limit is reached or a stop was requested (data parallel: agreed by every rank).
  bool done() const;
  // Whether the batch that just ended (`batch_in_epoch` batches consumed) validates.
  bool should_validate_now(int64_t batch_in_epoch, bool epoch_end) const;

  // --- stopping ---
  void request_stop(int exit_code);
  bool should_stop() const { return should_stop_; }
  // Data parallel: this rank's stop code (0 none, 1 stop, 3 NaN, 128+signal) is max-reduced on the
  // device after every optimizer step and read kStopLag calls later (the copy is long done: no
  // stall), so every rank stops after the same step; `blocking` (an epoch's end) agrees at once.
  void share_stop_code(bool blocking);
  // After run(): folds the agreed stop code (data parallel) and a signal into the exit code, and
  // returns the signal that stopped the run (0: none).
  int settle_stop();
  // fit()'s status: kExitOk, a callback's requested code (kExitNaN), or 128 + the signal.
  int exit_code() const { return stop_code_; }

 private:
  int local_stop_code() const;
  bool time_is_up() const;
  void finish_optimizer_step();
  // data.sources: each source's share of the batch's tokens, logged as train/tokens/<name>.
  void log_source_shares(const Batch& batch);

  class Progress : public Stateful {
   public:
    explicit Progress(FitLoop& loop) : loop_(loop) {}
    void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
    void load(const checkpoint::CheckpointData& in) override;
    bool training_only() const override { return false; }  // evaluation logs at the saved step

   private:
    FitLoop& loop_;
  };
  class Accumulation : public Stateful {
   public:
    explicit Accumulation(FitLoop& loop) : loop_(loop) {}
    void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
    void load(const checkpoint::CheckpointData& in) override;

   private:
    FitLoop& loop_;
  };

  LoopParts parts_;
  EvaluationLoop* evaluation_ = nullptr;
  distributed::Strategy& strategy_;
  int64_t world_size_;
  TrainingRunner* runner_ = nullptr;
  torch::optim::Optimizer* optimizer_ = nullptr;
  LRScheduler* scheduler_ = nullptr;
  Freeze* freeze_ = nullptr;
  int64_t accum_count_ = 0;
  std::vector<std::string> source_names_;  // data.sources (DataInfo::source_names)
  // data.exclude: the training loader's exclusion the restored checkpoint's epoch ran with (its
  // `data_exclude` blob), reconciled with this run's at the first epoch run after the restore.
  std::optional<std::vector<int64_t>> restored_exclude_;
  // finish_epoch_with's loader, the config it was made from and its sources (reset at the epoch's end).
  std::shared_ptr<data::DataLoader> epoch_loader_;
  std::string epoch_config_yaml_;
  std::vector<std::string> epoch_source_names_;
  Progress progress_{*this};
  Accumulation accumulation_{*this};
  std::shared_ptr<data::DataLoader> loader_;
  TrainerState state_;
  int64_t num_batches_ = 0;
  int64_t epoch_batches_ = 0;     // a whole epoch's batches after the limits (num_batches_ unless rebased)
  int64_t limited_batches_ = -1;  // the limit that cut them (limit_train_batches, overfit_batches, fast_dev_run), or -1
  double last_input_wait_s_ = 0.0;
  std::chrono::steady_clock::time_point start_time_;
  bool should_stop_ = false;
  int stop_code_ = 0;
  std::deque<DeviceReadback> pending_stops_;  // the all-reduced [stop code, validation due] (int32) on their way to the host
  int agreed_stop_ = 0;                       // the max over ranks of the stop codes read so far
  // Validation by time (trainer.val_check_interval as a duration): the training clock (elapsed_s's)
  // at the last validation, the validations it made, and whether one is due after this step (data
  // parallel: when the ranks' agreement says a rank found it due, the same call on every rank).
  double val_clock_s_ = 0;
  int64_t time_validations_ = 0;
  bool validation_due_ = false;
  double training_clock_s() const;
  int local_validation_due() const;  // time_validations_ + 1 when this rank's clock is past the interval
};

}  // namespace strobe
