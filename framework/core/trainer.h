// Trainer: the fit / validate / test / predict loops around a Module and a DataModule.
//
// The implementation is split by job: trainer.cpp (construction, the fit/validate/test/predict entry
// points, signals), trainer_loops.cpp (epoch and evaluation loops), trainer_step.cpp (one training
// batch and the optimizer step, through StepPipeline), trainer_state.cpp (the state connector:
// checkpoints, resume, RNG).
//
// Contract:
// - The step path makes no host-device synchronization of its own: losses and metrics are logged
//   as device tensors and reach the host through LogCollector's async ring; the optimizer step is
//   StepPipeline's (see step_pipeline.h for the one documented host read of the torch::optim path).
// - All loop state lives in TrainerState and, with every other piece of state (model, optimizer,
//   scheduler, loss scaler, accumulation, logger accumulators, step-guard flag, stop state, RNG,
//   callbacks, resolved config), is registered with the StateConnector; resuming continues with the
//   same batches, RNG draws and (on CPU) bitwise the same losses.
// - SIGINT/SIGTERM in the training loop finish the current optimizer step (said at once on stderr),
//   write checkpoints/last.ckpt and make fit() return 130/143; a second signal exits at once saying
//   nothing was saved; outside the loop a signal exits at once with one line (signals.h).
// - Data parallel (docs/DISTRIBUTED.md): the strategy owns the device and the ranks. Gradients are
//   all-reduced on the last micro-batch of each optimizer step only, before the step pipeline's
//   check and clipping; loss-only non-finite verdicts are merged across ranks on the device; epoch
//   means and metric collections are synced before callbacks read them; stop requests, signals and
//   max_time are agreed across ranks (the same step on every rank); rank 0 alone writes console
//   output, metrics.csv, TensorBoard, checkpoints and config.yaml; a checkpoint holds every rank's
//   RNG and the world size, and resumes exactly on the same number of ranks.
// - trainer.cuda_graphs: the step from the forward to the optimizer is captured once and replayed
//   (graph_step.h, trainer_graph.cpp); the hooks around it and the logging are unchanged.
// - Resuming compares the checkpoint's resolved config with this one before restoring anything
//   (resume_compat.h): incompatible changes are a CheckpointError, allowed ones are listed.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "framework/config/experiment.h"
#include "framework/core/callback.h"
#include "framework/core/datamodule.h"
#include "framework/core/loop_state.h"
#include "framework/core/device_transfer.h"
#include "framework/core/master_weights.h"
#include "framework/core/module.h"
#include "framework/core/optim.h"
#include "framework/core/state_connector.h"
#include "framework/core/step_pipeline.h"
#include "framework/core/step_runner.h"
#include "framework/logging/device_readback.h"

namespace strobe {

namespace logging {
class LogCollector;
class CsvLogger;
class MetricConsumer;
}  // namespace logging
namespace checkpoint {
struct CheckpointData;
}
namespace distributed {
class Strategy;
}
class GradScaler;
struct GraphedStep;

// The SIGINT/SIGTERM received since fit() installed its handlers (0: none).
int received_stop_signal();

// Exit status of fit(): CONFIG.md's codes.
enum ExitCode : int { kExitOk = 0, kExitFailure = 1, kExitUsage = 2, kExitNaN = 3, kExitSigint = 130, kExitSigterm = 143 };

class Trainer {
 public:
  Trainer(config::Experiment experiment, std::string resolved_config_yaml, std::shared_ptr<Module> module,
          std::shared_ptr<DataModule> datamodule, std::vector<std::shared_ptr<Callback>> callbacks, std::string run_dir,
          std::shared_ptr<distributed::Strategy> strategy = nullptr);  // null: one process on trainer.device
  ~Trainer();

  int fit(const std::optional<std::string>& ckpt_path = std::nullopt);
  int validate(const std::optional<std::string>& ckpt_path = std::nullopt);
  int test(const std::optional<std::string>& ckpt_path = std::nullopt);
  std::vector<torch::Tensor> predict(const std::optional<std::string>& ckpt_path = std::nullopt);

  // --- the view callbacks and tools use ---
  const TrainerState& state() const { return state_; }
  const config::TrainerConfig& config() const { return exp_.trainer; }
  const config::Experiment& experiment() const { return exp_; }
  const std::string& run_dir() const { return run_dir_; }
  const torch::Device& device() const { return device_; }
  bool should_stop() const { return should_stop_; }
  void request_stop(int exit_code = kExitOk);
  bool sanity_checking() const { return sanity_checking_; }
  bool is_global_zero() const { return rank_ == 0; }
  int64_t world_size() const { return world_size_; }
  int64_t rank() const { return rank_; }
  distributed::Strategy& strategy() { return *strategy_; }
  // Data parallel: rank 0's value on every rank (a decision read from rank-local values); a
  // collective: every rank calls it at the same point. Identity with one process.
  std::optional<double> rank0_value(std::optional<double> value);
  // Host values of the latest delivered metrics (never forces a sync).
  const std::map<std::string, double>& metrics() const;
  // Waits for every pending metric copy (epoch-end decisions only).
  void drain_metrics();
  Module& module() { return *module_; }
  DataModule& datamodule() { return *datamodule_; }
  torch::optim::Optimizer* optimizer() { return optimizer_.get(); }
  LRScheduler* scheduler() { return scheduler_.get(); }
  int64_t num_training_batches() const { return num_train_batches_; }
  int64_t estimated_stepping_batches() const;
  // The step pipeline (after setup_for_fit). Callbacks arm its guard with arm_step_guard(), which
  // also works before the pipeline exists.
  StepPipeline& step_pipeline();
  void arm_step_guard(const StepGuard& guard);
  // Host seconds the training loop spent waiting for the loader's current batch (strobe bench's
  // input-wait; read in on_train_batch_start).
  double last_input_wait_s() const { return last_input_wait_s_; }
  // Micro-batches already run in the current optimizer step (0 at a step boundary).
  int64_t accumulated_batches() const { return accum_count_; }
  StateConnector& state_connector() { return connector_; }
  // Adds a callback after construction (replay's observer); its hooks run after the others'.
  void add_callback(std::shared_ptr<Callback> callback);
  void add_metric_consumer(logging::MetricConsumer* consumer);
  // Host-side values (learning rate, throughput): delivered to the loggers at once.
  void log_host(const std::vector<std::pair<std::string, double>>& values);
  // The same for a given step's row (a callback that learns of a step's outcome later).
  void log_host_at(int64_t step, int64_t epoch, const std::vector<std::pair<std::string, double>>& values);

  void set_resolved_config(std::string yaml) { config_yaml_ = std::move(yaml); }
  void save_checkpoint(const std::string& path);
  // The live state, or with `step_start` the state at that step's start (loop_state.h: StepStart).
  checkpoint::CheckpointData make_checkpoint(const StepStart* step_start = nullptr);
  void load_checkpoint(const std::string& path, bool restore_training_state);
  // `source` names the data in error messages (a file, a capture).
  void load_checkpoint_data(const checkpoint::CheckpointData& data, bool restore_training_state, const std::string& source);
  void restore_rng(const checkpoint::CheckpointData& data);

  // Lets an embedding program (tests, replay) run single steps with the full step path.
  void setup_for_fit();
  torch::Tensor run_training_batch(Batch host_batch, int64_t batch_idx);
  // trainer.cuda_graphs: steps captured / replayed so far in this process (0 / 0 without it).
  int64_t graph_captures() const;
  int64_t graph_replays() const;

 private:
  void setup_common(Stage stage);
  void train_epoch();
  void run_eval(Stage stage, int64_t limit, bool sanity);
  bool should_validate_now(int64_t batch_in_epoch, bool epoch_end) const;
  bool done() const;
  Batch prepare_batch(Batch batch, int64_t dataloader_idx);
  // After the update (eager or replayed): callbacks, zero_grad, counters, scheduler, logging.
  void finish_optimizer_step(bool zero_grads);
  // trainer.cuda_graphs (trainer_graph.cpp): checks at setup, and one graphed (or eager) step.
  void setup_cuda_graphs();
  torch::Tensor run_graphed_batch(Batch batch, int64_t batch_idx);
  torch::Tensor run_eager_batch(Batch batch, int64_t batch_idx);  // `batch` on the device
  class EagerStepHooks;  // StepRunner's hooks in the eager loop: callbacks and the strategy
  // Data parallel stop agreement: this rank's stop code (0 none, 1 stop, 3 NaN, 128+signal) is
  // max-reduced on the device after every optimizer step and read kStopLag steps later (the event
  // is long done: no stall), so every rank stops after the same step; at epoch ends it is agreed
  // at once (blocking).
  int local_stop_code() const;
  void share_stop_code(bool blocking);
  bool time_is_up() const;
  void install_signal_handlers();
  // A resume needs the checkpoint's number of processes; else CheckpointError (exit 2) on every rank.
  void check_resume_world_size(const std::string& source, const checkpoint::CheckpointData& data) const;
  void register_state();
  template <class F>
  void each(F&& f) {
    for (auto& cb : callbacks_) f(*cb);
  }

  config::Experiment exp_;
  std::string config_yaml_;
  std::string resume_changes_;  // the allowed config changes of the last resume, listed by fit()
  std::shared_ptr<Module> module_;
  std::shared_ptr<DataModule> datamodule_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  std::string run_dir_;
  torch::Device device_{torch::kCPU};
  int64_t rank_ = 0;
  int64_t world_size_ = 1;
  std::shared_ptr<distributed::Strategy> strategy_;
  std::deque<DeviceReadback> pending_stops_;  // the all-reduced stop codes (0-d int32) on their way to the host
  int agreed_stop_ = 0;  // the max over ranks of the stop codes read so far

  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::shared_ptr<LRScheduler> scheduler_;
  OptimizerInfo optimizer_info_;
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<MasterWeights> masters_;  // precision bf16-master
  std::unique_ptr<logging::LogCollector> collector_;
  std::unique_ptr<logging::CsvLogger> csv_;
  std::unique_ptr<logging::MetricConsumer> tensorboard_;
  std::unique_ptr<StepPipeline> pipeline_;
  std::unique_ptr<StepRunner> step_runner_;  // one micro-batch, eager or captured
  std::unique_ptr<GraphedStep> graph_;  // trainer.cuda_graphs
  StepGuard pending_guard_;
  StateConnector connector_;

  TrainerState state_;
  int64_t num_train_batches_ = 0;
  bool should_stop_ = false;
  int stop_code_ = kExitOk;
  bool sanity_checking_ = false;
  bool fit_setup_done_ = false;
  int64_t accum_count_ = 0;
  double last_input_wait_s_ = 0.0;
  std::chrono::steady_clock::time_point start_time_;
  std::shared_ptr<data::DataLoader> train_loader_;
  BatchTransfer transfer_;  // host-to-device copies on a copy stream (CUDA)
};

}  // namespace strobe
