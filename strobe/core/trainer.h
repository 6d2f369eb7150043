// Trainer: the fit / validate / test / predict entry points around a Module and a DataModule. It
// builds and wires its parts; each is a class of its own:
//
//   FitLoop         loops.h, fit_loop.cpp         epochs, the loop counters (TrainerState), the
//                                                  training limits, when to validate, stopping, the
//                                                  accumulation window and the end of each step
//   EvaluationLoop  loops.h, evaluation_loop.cpp  one validation or test run
//   PredictLoop     loops.h, evaluation_loop.cpp  one prediction run
//   EagerRunner     step_runner.h                 what FitLoop calls for a micro-batch: StepRunner
//                                                  with the callbacks' and the strategy's hooks
//   GraphedRunner   graph_step.h                  trainer.cuda_graphs: capture and replay (falls
//                                                  back to the EagerRunner)
//   StepRunner      step_runner.h                 one micro-batch, forward to update: the eager step
//                                                  and the CUDA-graph capture run the same code
//   StepPipeline    step_pipeline.h               the device-side optimizer step (checks, clipping,
//                                                  loss scaling, skip)
//   StateConnector  state_connector.h, trainer_state.cpp  the one list of what a checkpoint holds
//   TrainerView     trainer_view.h                what callbacks see (the Trainer implements it
//   StepAccess      trainer_view.h                privately); NaN capture's narrow interface
//
// trainer.cpp: construction, the entry points, signals; trainer_step.cpp: building the step's parts
// (the pipeline, the runners) and the cuda_graphs checks. The Trainer is built once from its parts
// (TrainerParts) and builds and wires; a step's path runs downward from FitLoop and never calls back
// into the Trainer.
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
//   (graph_step.h); the hooks around it and the logging are unchanged.
// - Resuming compares the checkpoint's resolved config with this one before restoring anything
//   (resume_compat.h): incompatible changes are a CheckpointError, allowed ones are listed.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/experiment.h"
#include "strobe/config/resume_check.h"
#include "strobe/core/callback.h"
#include "strobe/core/datamodule.h"
#include "strobe/core/loop_state.h"
#include "strobe/core/loops.h"
#include "strobe/core/device_transfer.h"
#include "strobe/core/freeze.h"
#include "strobe/core/master_weights.h"
#include "strobe/core/module.h"
#include "strobe/core/optim.h"
#include "strobe/core/run_state.h"
#include "strobe/core/state_connector.h"
#include "strobe/core/step_pipeline.h"
#include "strobe/core/step_runner.h"
#include "strobe/core/trainer_view.h"

namespace strobe {

struct ConfigComparison;  // resume_compat.h

class Fp8Layers;

namespace logging {
class LogCollector;
class CsvLogger;
class MetricConsumer;
class MlflowLogger;
}  // namespace logging
namespace distributed {
class Strategy;
class Zero2Shards;
}
namespace config {
class SavedConfig;
}
class GradScaler;
class GraphedRunner;
class ShardedCheckpoint;


// What a Trainer is built from. build_run (runner/experiment_builder.h) makes one from a config;
// a program embedding Strobe may make its own.
struct TrainerParts {
  config::Experiment experiment;
  // The experiment's YAML with every default filled in (required): config.yaml and each checkpoint's
  // `config`, which a resume compares with its own.
  std::string resolved_config;
  std::shared_ptr<Module> module;
  std::shared_ptr<DataModule> datamodule;
  std::vector<std::shared_ptr<Callback>> callbacks;  // their hooks run in this order
  std::string run_dir;  // empty: no files at all
  std::shared_ptr<distributed::Strategy> strategy;  // null: one process on trainer.device
  // The Hugging Face config.json the initial weights came with (model.init_from, names: hf), empty
  // when none: every checkpoint keeps it (blob `hf_config`, restored on resume) so `export --names hf`
  // writes its fields back (max_position_embeddings, bos/eos token ids, ...).
  std::string hf_source_config;
  // The saved config of the checkpoint the command loads (--ckpt), when whoever read the checkpoint
  // parsed it already (build_run reads its plugins): the resume check compares it without parsing it
  // again. Null: parsed from the checkpoint.
  std::shared_ptr<const config::SavedConfig> checkpoint_config;
};

// The composition root: built once from its parts, it builds and wires the loops, the step and the
// state, and runs them. It implements TrainerView and StepAccess privately: callbacks reach them
// through their hooks' argument, a program through view().
class Trainer : private TrainerView, private StepAccess {
 public:
  // Throws config::ConfigError for a precision the device cannot run or two callbacks that share a
  // state key.
  explicit Trainer(TrainerParts parts);
  ~Trainer();

  // Each entry point takes an optional checkpoint (checkpoint::load_checkpoint_file; its `source`
  // names it in messages). fit resumes from it: the whole training state, after checking its config
  // against this one (resume_compat.h) and its number of processes; validate, test and predict load
  // its weights (strictly: every name and shape). fit's optimizer, scheduler and step are built on
  // its first call: their config errors (optimizer.fused: true that cannot be had, trainer.cuda_graphs:
  // true that cannot be captured, a cosine schedule without a run length) are thrown before any step.
  int fit(std::optional<checkpoint::CheckpointData> resume = std::nullopt);
  // Lines fit() prints (rank 0, stderr, "strobe: " before each) once a resume's checks have passed
  // and before training: what composing the config did (config::Document::notes()).
  void set_start_notes(std::vector<std::string> notes) { start_notes_ = std::move(notes); }
  int validate(std::optional<checkpoint::CheckpointData> weights = std::nullopt);
  int test(std::optional<checkpoint::CheckpointData> weights = std::nullopt);
  std::vector<torch::Tensor> predict(std::optional<checkpoint::CheckpointData> weights = std::nullopt,
                                     Stage split = Stage::Predict, PredictSink* sink = nullptr);

  // What callbacks see (trainer_view.h): the loop counters, metrics, the optimizer, checkpoints.
  TrainerView& view() { return *this; }
  const TrainerView& view() const { return *this; }

  // Single training steps, for programs that drive them (replay, tests, benchmarks). resume_state
  // restores what fit(resume) restores, without running the loop; run_batch sends one micro-batch
  // down fit's step path (FitLoop::run_batch: the hooks, the runner, the end of the optimizer step)
  // and returns its loss. Both build fit's parts on first use.
  void resume_state(const checkpoint::CheckpointData& data);
  torch::Tensor run_batch(Batch host_batch, int64_t batch_idx);

  // trainer.cuda_graphs: the steps captured and replayed so far (0 and 0 without it).
  struct GraphCounts {
    int64_t captures = 0, replays = 0;
  };
  GraphCounts graph_counts() const;

 private:
  // --- TrainerView (trainer_view.h: each member's contract) ---
  const config::TrainerConfig& config() const override { return exp_.trainer; }
  const std::string& run_dir() const override { return run_dir_; }
  const torch::Device& device() const override { return device_; }
  const TrainerState& state() const override { return fit_loop_->state(); }
  int64_t accumulated_batches() const override { return fit_loop_->accumulated_batches(); }
  int64_t num_training_batches() const override { return fit_loop_->num_batches(); }
  int64_t estimated_stepping_batches() const override { return fit_loop_->estimated_stepping_batches(); }
  bool sanity_checking() const override { return sanity_checking_; }
  double last_input_wait_s() const override { return fit_loop_->last_input_wait_s(); }
  bool is_global_zero() const override { return rank_ == 0; }
  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return world_size_; }
  std::optional<double> rank0_value(std::optional<double> value) override;
  const std::map<std::string, double>& metrics() const override;
  std::optional<int64_t> metric_step(const std::string& name) const override;
  void drain_metrics() override;
  void log_host(const std::vector<std::pair<std::string, double>>& values) override;
  void log_host_at(int64_t step, int64_t epoch, const std::vector<std::pair<std::string, double>>& values) override;
  torch::optim::Optimizer* optimizer() override { return optimizer_.get(); }
  const std::vector<std::string>& param_group_names() const override { return param_group_names_; }
  std::vector<std::pair<std::string, torch::Tensor>> weights() override;
  ShardedWeights* sharded_weights() override;
  LRScheduler* scheduler() override { return scheduler_.get(); }
  DataModule& datamodule() override { return *datamodule_; }
  int64_t forward_over_training_data(int64_t epoch) override { return fit_loop_->forward_over_training_data(epoch); }
  void request_stop(int exit_code = kExitOk) override { fit_loop_->request_stop(exit_code); }
  bool should_stop() const override { return fit_loop_->should_stop(); }
  void save_checkpoint(const std::string& path) override;
  checkpoint::CheckpointData make_checkpoint() override;
  StepAccess& step_access() override { return *this; }

  // --- StepAccess (NaN capture) ---
  void arm_step_guard(const StepGuard& guard) override;
  const StepPipelineView& step_pipeline() const override;
  checkpoint::CheckpointData make_checkpoint_at(const StepStart& start) override;

  // The data and the callbacks set up for `stage`; with `weights`, those loaded (load_weights).
  void setup_common(Stage stage, std::optional<checkpoint::CheckpointData> weights = std::nullopt);
  int evaluate(Stage stage, std::optional<checkpoint::CheckpointData> weights);  // validate, test
  // fit's parts, once: the training loader, the optimizer and scheduler, the step pipeline, the
  // runners and their state entries.
  void setup_fit();
  // Restores `data` (resume_state's contract) and returns the allowed config changes it carries
  // ("" when none), which fit lists.
  std::vector<config::ConfigChange> restore_training_state(const checkpoint::CheckpointData& data);
  // After a resume's restore: the schedule's length is the checkpoint's unless `changes` (the allowed
  // changes restore_training_state found against its config) hold trainer.max_steps,
  // trainer.max_epochs or scheduler.max_steps; returns what the resume line says of it ("" when the
  // length is the same).
  std::string settle_schedule_length(const std::vector<config::ConfigChange>& changes);
  // validate/test/predict: the weights alone, strictly.
  void load_weights(const checkpoint::CheckpointData& data);
  // The step's runners (trainer_step.cpp), handed to FitLoop: the eager one, and under
  // trainer.cuda_graphs the graphed one when the run can be captured (setup_cuda_graphs says why not).
  void setup_runners();
  void setup_cuda_graphs();

  void install_signal_handlers();
  // A resume on another number of processes or with another batch (data.batch_size x processes):
  // ddp or one process on both sides, not a rank's own state, not inside an accumulation window;
  // otherwise one CheckpointError (exit 2) on every rank. The same batch continues at the same batch
  // index; another one goes on from the samples of the epoch consumed (resume_samples_, applied by
  // restore_training_state through FitLoop::rebase_to_samples). Sets world_size_note_ for the resume
  // line. `saved_config`: the checkpoint's, parsed once for the resume (compare_configs); null when
  // it holds none.
  void check_resume_world_size(const checkpoint::CheckpointData& data, const config::SavedConfig* saved_config);
  // A resume in the middle of an epoch under a data config that reorders it (a mix's sources or
  // weights, data.packing): the epoch finishes with the data module of the config it began under
  // (the checkpoint's, or its data_epoch_config record), this run's from the next epoch; a config
  // that cannot be built now is one CheckpointError. Sets data_epoch_note_ for the resume line.
  void finish_epoch_with_its_data(const checkpoint::CheckpointData& data, const ConfigComparison& configs,
                                  const TrainerState& loop);
  void register_state();
  void register_fit_state();  // the optimizer, scheduler, scaler and step pipeline, once they exist
  // The live state, or with `step_start` the state at that step's start (loop_state.h: StepStart).
  checkpoint::CheckpointData build_checkpoint(const StepStart* step_start);
  // How this run's checkpoints are laid out on disk: one file, or zero2's shards (sharded_checkpoint.h).
  ShardedCheckpoint sharded_checkpoint() const;
  // The whole shape of each parameter the optimizer updates, by group and position.
  std::vector<std::vector<std::vector<int64_t>>> optimizer_shapes() const;
  // `hook` names the hook for a callback that throws what is not a std::exception (call_hook).
  template <class F>
  void each(const char* hook, F&& f) {
    for (auto& cb : callbacks_) call_hook(*cb, hook, [&] { f(*cb); });
  }

  config::Experiment exp_;
  std::string config_yaml_;
  std::shared_ptr<const config::SavedConfig> checkpoint_config_;
  std::string hf_source_config_;  // empty: none
  std::shared_ptr<Module> module_;
  std::shared_ptr<DataModule> datamodule_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  std::string run_dir_;
  torch::Device device_{torch::kCPU};
  int64_t rank_ = 0;
  int64_t world_size_ = 1;
  std::string world_size_note_;  // the resume line's "2 process(es) -> 1, ..." (empty: nothing changed)
  // A mid-epoch resume whose data config reorders the epoch: the data module the epoch finishes
  // with, and the resume line's note of when the change applies (finish_epoch_with_its_data).
  std::shared_ptr<DataModule> epoch_data_module_;
  std::string data_epoch_note_;
  std::optional<int64_t> resume_samples_;  // a batch-changing resume's samples of the epoch consumed
  std::shared_ptr<distributed::Strategy> strategy_;

  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::shared_ptr<LRScheduler> scheduler_;
  std::vector<std::string> param_group_names_;
  std::string param_groups_text_;  // param_groups.txt, written by rank 0 when fit starts
  std::vector<std::string> start_notes_;
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<MasterWeights> masters_;  // precision bf16-master
  std::unique_ptr<Fp8Layers> fp8_;          // trainer.fp8: the layers marked for float8 GEMMs
  distributed::Zero2Shards* zero2_ = nullptr;  // trainer.strategy zero2 (the strategy owns it)
  class FsdpWeights;
  std::unique_ptr<FsdpWeights> fsdp_weights_;  // sharded_weights() under fsdp
  std::unique_ptr<Freeze> freeze_;          // optimizer.param_groups.freeze
  std::unique_ptr<logging::LogCollector> collector_;
  std::unique_ptr<logging::CsvLogger> csv_;
  std::unique_ptr<logging::MetricConsumer> tensorboard_;
  std::unique_ptr<logging::MlflowLogger> mlflow_;  // logger.mlflow (rank 0)
  void finish_mlflow(const char* status);
  std::unique_ptr<StepPipeline> pipeline_;
  std::unique_ptr<StepRunner> step_runner_;  // one micro-batch, eager or captured
  std::unique_ptr<CallbackStepHooks> step_hooks_;  // the eager step's hooks: callbacks and the strategy
  std::unique_ptr<EagerRunner> eager_runner_;
  std::unique_ptr<GraphedRunner> graphed_runner_;  // trainer.cuda_graphs
  StepGuard pending_guard_;
  // The state objects the connector holds (run_state.h) besides the loops, the step pipeline, the
  // collector, the scheduler and the scaler, which are Stateful themselves.
  std::unique_ptr<ModelState> model_state_;
  std::unique_ptr<RngState> rng_state_;
  std::unique_ptr<CallbackStates> callback_states_;
  std::unique_ptr<TextRecord> config_record_, hf_record_;
  std::unique_ptr<MetaRecord> meta_record_;
  std::unique_ptr<MlflowRecord> mlflow_record_;
  std::unique_ptr<OptimizerState> optimizer_state_;
  StateConnector connector_;

  std::unique_ptr<EvaluationLoop> eval_loop_;  // validation and test runs
  std::unique_ptr<FitLoop> fit_loop_;          // the epochs, the loop counters and the stop state
  std::unique_ptr<PredictLoop> predict_loop_;
  bool sanity_checking_ = false;
  bool fit_setup_done_ = false;
  std::unique_ptr<BatchPreparer> preparer_;  // the loops' and predict's way onto the device
};

}  // namespace strobe
