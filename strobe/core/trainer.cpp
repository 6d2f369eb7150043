#include "strobe/core/engine_access.h"
#include "strobe/core/trainer.h"

// Trainer: construction (the loops wired to the step, the data and the callbacks), the fit /
// validate / test / predict entry points and signal handling. The loops are fit_loop.cpp and
// evaluation_loop.cpp; the step's parts and the state are trainer_step.cpp and trainer_state.cpp.
#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <set>

#include <ATen/Context.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/checkpoint_keys.h"
#include "strobe/config/saved_config.h"
#include "strobe/core/checkpoint_view.h"
#include "strobe/core/loop_state.h"
#include "strobe/core/fp8.h"
#include "strobe/core/graph_step.h"
#include "strobe/core/optim.h"
#include "strobe/core/precision.h"
#include "strobe/core/signals.h"
#include "strobe/distributed/strategy.h"
#include "strobe/logging/csv_logger.h"
#include "strobe/logging/log_collector.h"
#include "strobe/logging/mlflow_logger.h"
#include "strobe/logging/tensorboard_logger.h"

namespace strobe {



Trainer::Trainer(TrainerParts parts)
    : exp_(std::move(parts.experiment)),
      config_yaml_(std::move(parts.resolved_config)),
      checkpoint_config_(std::move(parts.checkpoint_config)),
      hf_source_config_(std::move(parts.hf_source_config)),
      module_(std::move(parts.module)),
      datamodule_(std::move(parts.datamodule)),
      callbacks_(std::move(parts.callbacks)),
      run_dir_(std::move(parts.run_dir)),
      strategy_(std::move(parts.strategy)) {
  if (config_yaml_.empty() || !module_ || !datamodule_)
    throw std::invalid_argument("Trainer: TrainerParts needs the resolved config, the module and the datamodule");
  if (!strategy_) {
    distributed::StrategyOptions o;
    o.device = exp_.trainer.device;
    strategy_ = distributed::make_strategy(o, distributed::LaunchEnv{});  // one process
  }
  device_ = strategy_->device();
  rank_ = strategy_->rank();
  world_size_ = strategy_->world_size();
  if (exp_.trainer.precision == Precision::k16Mixed && !device_.is_cuda())
    throw config::ConfigError("trainer.precision: 16-mixed needs a CUDA device (use bf16-mixed on CPU)");
  if (exp_.trainer.deterministic) {
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
  torch::manual_seed(static_cast<uint64_t>(exp_.seed));
  auto* model = dynamic_cast<Model*>(&module_->net());
  if (exp_.trainer.precision == Precision::kBf16Master && strategy_->sharding()) {
    // zero2 with several processes, the host-side build (docs/DISTRIBUTED.md, "Building the model
    // under zero2"): the GPU receives the bf16 working weights, and the fp32 values stay on the host
    // until setup_fit cuts this rank's master shards from them (Zero2Shards).
    masters_ = std::make_unique<MasterWeights>(module_->net(), torch::kBFloat16, device_);
    module_->net().to(device_);  // what stays in fp32 (BatchNorm) and the integer buffers
    if (model) model->on_device(device_, exp_.trainer.precision);
    if (model) model->set_input_dtype(torch::kBFloat16);
  } else {
    module_->net().to(device_);
    if (model) model->on_device(device_, exp_.trainer.precision);
    if (exp_.trainer.precision == Precision::kBf16Master) {
      masters_ = std::make_unique<MasterWeights>(module_->net());
      if (model) model->set_input_dtype(torch::kBFloat16);
    }
  }
  if (exp_.trainer.fp8.enabled) {
    check_fp8_run(exp_.trainer.precision, device_);
    const YAML::Node name = exp_.model.node()["name"];
    const std::string model_name = name.IsScalar() ? name.Scalar() : module_->net().name();
    fp8_ = std::make_unique<Fp8Layers>(
        module_->net(), select_fp8_layers(module_->net(), model ? model->fp8_layers() : std::vector<std::string>{},
                                          exp_.trainer.fp8, model_name));
  }
  collector_ = std::make_unique<logging::LogCollector>(device_);
  // The loops: wired to this trainer's parts (the view callbacks get, the batch preparation).
  preparer_ = std::make_unique<BatchPreparer>(*datamodule_, *module_, device_);
  LoopParts loop_parts;
  loop_parts.view = &view();
  loop_parts.module = module_.get();
  loop_parts.datamodule = datamodule_.get();
  loop_parts.collector = collector_.get();
  loop_parts.cfg = &exp_.trainer;
  loop_parts.device = device_;
  loop_parts.callbacks = &callbacks_;
  loop_parts.preparer = preparer_.get();
  loop_parts.global_zero = rank_ == 0;
  fit_loop_ = std::make_unique<FitLoop>(loop_parts, *strategy_, world_size_);
  eval_loop_ = std::make_unique<EvaluationLoop>(loop_parts, fit_loop_->state());
  fit_loop_->set_evaluation(eval_loop_.get());
  predict_loop_ = std::make_unique<PredictLoop>(loop_parts);
  std::set<std::string> keys;
  for (auto& cb : callbacks_)
    if (!keys.insert(cb->state_key()).second)
      throw config::ConfigError(fmt::format("callbacks: two callbacks share the state key '{}'", cb->state_key()));
  register_state();
  if (world_size_ > 1) {
    strategy_->set_record_dir(run_dir_);
    // Last in the constructor, once the parameters are final (device, layout, dtype): every rank
    // starts from rank 0's weights and the Reducer's hooks go on the parameters the optimizer steps.
    strategy_->setup_model(module_->net());
    collector_->set_epoch_reducer([s = strategy_.get()](torch::Tensor& t) { s->reduce_sum(t, distributed::CollectiveKind::kEpochSums); }, rank_ == 0);
    EngineAccess::set_metric_sync(*module_, [s = strategy_.get()](metrics::MetricCollection& c) { s->sync_metrics(c); });
  }
}

// trainer.strategy fsdp: weights() are the optimizer's fp32 shards (zero2's order), then the
// floating buffers, whole (`shapes`: every weight's whole shape, taken once).
class Trainer::FsdpWeights : public ShardedWeights {
 public:
  FsdpWeights(distributed::Zero2Shards& shards, std::vector<std::vector<int64_t>> shapes)
      : shards_(shards), shapes_(std::move(shapes)) {}
  torch::Tensor whole(size_t i, const torch::Tensor& rows) override {
    return i < shards_.shards().size() ? shards_.full_value(i, rows) : rows;
  }
  torch::Tensor rows_of(size_t i, const torch::Tensor& whole) override {
    return i < shards_.shards().size() ? shards_.rows_of(i, whole) : whole;
  }
  std::vector<int64_t> whole_shape(size_t i) override { return shapes_.at(i); }
  void changed() override { shards_.gather_params(); }  // fsdp: into the units, the kept ones gathered again

 private:
  distributed::Zero2Shards& shards_;
  std::vector<std::vector<int64_t>> shapes_;
};

Trainer::~Trainer() = default;

const std::map<std::string, double>& Trainer::metrics() const { return collector_->latest(); }
std::optional<int64_t> Trainer::metric_step(const std::string& name) const {
  const auto& steps = collector_->latest_steps();
  auto it = steps.find(name);
  if (it == steps.end()) return std::nullopt;
  return it->second;
}
void Trainer::drain_metrics() { collector_->drain(); }
void Trainer::log_host(const std::vector<std::pair<std::string, double>>& values) {
  collector_->emit_host(state().global_step, state().epoch, values);
}

void Trainer::log_host_at(int64_t step, int64_t epoch, const std::vector<std::pair<std::string, double>>& values) {
  collector_->emit_host(step, epoch, values);
}

ShardedWeights* Trainer::sharded_weights() {
  if (!zero2_ || !zero2_->fully_sharded()) return nullptr;
  if (!fsdp_weights_) {
    std::vector<std::vector<int64_t>> shapes;  // the parameters' whole shapes, then the buffers'
    const auto w = weights();
    for (size_t i = 0; i < w.size(); ++i)
      shapes.push_back((i < zero2_->params().size() ? zero2_->params()[i] : w[i].second).sizes().vec());
    fsdp_weights_ = std::make_unique<FsdpWeights>(*zero2_, std::move(shapes));
  }
  return fsdp_weights_.get();
}

std::vector<std::pair<std::string, torch::Tensor>> Trainer::weights() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  if (zero2_ && zero2_->fully_sharded()) {  // fsdp: the parameters hold no values between steps
    for (size_t i = 0; i < zero2_->shards().size(); ++i) out.emplace_back(zero2_->names()[i], zero2_->shards()[i]);
  } else {
    // zero2 keeps no whole fp32 masters: bf16-master's weights are then the (bf16) parameters.
    for (const auto& p : module_->net().named_parameters())
      out.emplace_back(p.key(), (masters_ ? masters_->master_of(p.value()) : p.value()).detach());
  }
  for (const auto& b : module_->net().named_buffers())
    if (b.value().is_floating_point()) out.emplace_back(b.key(), b.value());
  return out;
}

void Trainer::setup_common(Stage stage, std::optional<checkpoint::CheckpointData> weights) {
  datamodule_->setup(stage);
  each("setup", [&](Callback& cb) { cb.setup(*this, *module_, stage); });
  if (weights) load_weights(*weights);  // and let them go on return
}

void Trainer::setup_fit() {
  if (fit_setup_done_) return;
  fit_setup_done_ = true;
  auto& c = exp_.trainer;
  setup_common(Stage::Fit);
  auto loader = datamodule_->train_loader();
  if (!loader) throw std::runtime_error(fmt::format("data '{}' has no training set", exp_.data.node()["name"].Scalar()));
  fit_loop_->setup(std::move(loader));

  auto setup = module_->configure_optimizers();
  optimizer_ = setup.optimizer;
  scheduler_ = setup.scheduler;
  if (optimizer_ && masters_)
    throw config::ConfigError(
        "trainer.precision: bf16-master needs the optimizer built from the optimizer: section (this task's "
        "configure_optimizers returns its own, which would update the bf16 weights directly)");
  if (optimizer_ && strategy_->sharding())
    throw config::ConfigError(
        "trainer.strategy: zero2 needs the optimizer built from the optimizer: section (this task's configure_optimizers "
        "returns its own, which would update the whole parameters instead of this rank's shards)");
  if (optimizer_ && !exp_.optimizer.param_groups.freeze.empty())
    exp_.optimizer.section.fail("param_groups", "freeze needs the optimizer built from the optimizer: section (this task's "
                                                "configure_optimizers returns its own)");
  if (!optimizer_) {
    // The frozen parameters are the optimizer's from the start (their own groups): the freeze takes
    // their gradients away below, before the first step.
    if (!exp_.optimizer.param_groups.freeze.empty()) freeze_ = std::make_unique<Freeze>(exp_.optimizer, module_->net());
    std::vector<distributed::ShardedParam> trainable;
    std::vector<torch::Tensor> trainable_params;
    for (auto& p : module_->net().named_parameters())
      if (p.value().requires_grad()) {
        trainable.push_back({p.key(), p.value(), masters_ ? masters_->master_of(p.value()) : p.value()});
        trainable_params.push_back(p.value());
      }
    // The strategy picks the tensors the optimizer updates (the whole fp32 values, or zero2's shards
    // of them) and calls this with them: the optimizer: section's groups over those tensors.
    const auto* model = dynamic_cast<const Model*>(&module_->net());
    auto built = strategy_->setup_optimizer(std::move(trainable), [&](const std::vector<std::pair<std::string, torch::Tensor>>& named) {
      const auto groups = make_param_groups(exp_.optimizer, named, model, freeze_ ? freeze_->names() : std::set<std::string>{});
      for (const auto& g : groups) param_group_names_.push_back(g.name);
      param_groups_text_ = describe_param_groups(groups);
      return build_optimizer(exp_.optimizer, groups, device_);
    });
    optimizer_ = std::move(built.optimizer);
    zero2_ = built.shards;
    if (zero2_) {  // the optimizer holds the shards: bf16-master's whole fp32 masters are let go
      if (masters_) {
        masters_->drop_masters(trainable_params);
        masters_->move_masters(device_);  // the host-side build's, of what the optimizer does not update
      }
      model_state_->set_sharded(zero2_, /*keep_whole_values=*/rank_ == 0);
      if (exp_.trainer.strategy == "fsdp") {
        // The parameters sharded too: each declared block a unit, gathered around it (fsdp.h).
        const auto globs = model ? model->fsdp_units() : std::vector<std::string>{};
        if (globs.empty())
          throw config::ConfigError(fmt::format("trainer.strategy: fsdp: model '{}' declares no units (Model::fsdp_units)",
                                                module_->net().name()));
        // Each module a glob matches is a block; a module inside one already taken belongs to it.
        std::vector<distributed::FsdpBlock> blocks;
        std::set<const void*> taken;
        for (const auto& m : module_->net().named_modules("", /*include_self=*/false)) {
          if (std::none_of(globs.begin(), globs.end(), [&](const std::string& g) { return glob_matches(g, m.key()); })) continue;
          distributed::FsdpBlock b{m.value(), {}};
          for (const auto& p : m.value()->named_parameters())
            if (taken.insert(p.value().unsafeGetTensorImpl()).second) b.params.emplace_back(m.key() + "." + p.key(), p.value());
          if (!b.params.empty()) blocks.push_back(std::move(b));
        }
        if (blocks.empty())
          throw config::ConfigError(fmt::format("trainer.strategy: fsdp: no module of model '{}' matches its units ({})",
                                                module_->net().name(), fmt::join(globs, ", ")));
        strategy_->shard_model(module_->net(), std::move(blocks), exp_.trainer.reshard_after_forward);
      }
    }
  }
  if (!scheduler_) scheduler_ = build_scheduler(exp_.scheduler, *optimizer_, estimated_stepping_batches());
  if (c.precision == Precision::k16Mixed) scaler_ = std::make_unique<GradScaler>(device_);
  pipeline_ = std::make_unique<StepPipeline>(exp_.trainer, module_->net(), *optimizer_, scaler_.get(),
                                             zero2_ ? nullptr : masters_.get());
  if (world_size_ > 1) pipeline_->set_strategy(strategy_.get());
  if (zero2_) pipeline_->set_sharded(zero2_);
  pipeline_->arm(pending_guard_);
  register_fit_state();
  setup_runners();
  eval_loop_->set_scheduler(scheduler_.get());
  if (freeze_) {
    freeze_->attach(module_->net(), world_size_ > 1 ? strategy_.get() : nullptr, graphed_runner_.get(), rank_);
    fit_loop_->set_freeze(freeze_.get());
    freeze_->update(state().epoch);
  }
}

void Trainer::install_signal_handlers() {
  signals::install();  // main has; a program embedding the trainer may not
  signals::reset();
}

void Trainer::resume_state(const checkpoint::CheckpointData& data) {
  setup_fit();
  restore_training_state(data);
}

torch::Tensor Trainer::run_batch(Batch host_batch, int64_t batch_idx) {
  setup_fit();
  return fit_loop_->run_batch(std::move(host_batch), batch_idx);
}

int Trainer::fit(std::optional<checkpoint::CheckpointData> resume) {
  setup_fit();
  const auto& c = exp_.trainer;
  const bool resumed = resume.has_value();
  if (resume) {
    const auto allowed = restore_training_state(*resume);
    const std::string changes = config::join_changes(allowed, 1000);
    const std::string schedule = settle_schedule_length(allowed);
    // Every resume says where it continues from, what changed, and what became of the schedule.
    if (rank_ == 0)
      fmt::print("strobe fit: resuming from {} (step {}){}{}{}{}\n", resume->source, state().global_step,
                 world_size_note_.empty() ? "" : " on " + world_size_note_,
                 changes.empty() ? "" : " with changes: " + changes, schedule.empty() ? "" : "; " + schedule,
                 data_epoch_note_.empty() ? "" : "; data: " + data_epoch_note_);
    resume.reset();  // the tensors are restored: let them go before training
  }
  if (rank_ == 0)
    for (const auto& note : start_notes_) fmt::print(stderr, "strobe: {}\n", note);
  if (rank_ == 0 && fp8_) fmt::print("strobe fit: trainer.fp8: {}\n", fp8_->summary());
  // Rank 0 alone writes the run's logs.
  if (!run_dir_.empty() && c.fast_dev_run == 0 && exp_.logger.mlflow && rank_ == 0) {
    // A resume continues the MLflow run its checkpoint names (on the same server), else a new run.
    // First of the loggers: on_unreachable: error refuses the run before any log file is made.
    try {
      mlflow_ = std::make_unique<logging::MlflowLogger>(*exp_.logger.mlflow, run_dir_, config_yaml_,
                                                        mlflow_record_->resumed_run(exp_.logger.mlflow->tracking_uri));
    } catch (const logging::MlflowError& e) {
      throw config::ConfigError(e.what());  // on_unreachable: error, before training
    }
    mlflow_record_->attach(mlflow_.get());
    collector_->add_consumer(mlflow_.get());
  }
  if (!run_dir_.empty() && c.fast_dev_run == 0 && exp_.logger.csv && rank_ == 0) {
    // On resume, the rows logged up to the checkpoint are kept and anything a crashed continuation
    // wrote after it is dropped.
    csv_ = std::make_unique<logging::CsvLogger>(run_dir_ + "/metrics.csv", resumed ? state().global_step : -1);
    collector_->add_consumer(csv_.get());
  }
  if (!run_dir_.empty() && c.fast_dev_run == 0 && exp_.logger.tensorboard && rank_ == 0) {
    // On resume, TensorBoard's restart marker hides what a crashed continuation logged after the checkpoint.
    tensorboard_ = std::make_unique<logging::TensorBoardLogger>(run_dir_, config_yaml_, resumed ? state().global_step : -1);
    collector_->add_consumer(tensorboard_.get());
  }
  // The optimizer's parameter groups (docs/CONFIG.md, "optimizer.param_groups"), for the user to read.
  if (!run_dir_.empty() && rank_ == 0 && !param_groups_text_.empty()) {
    try {
      checkpoint::write_file_atomic(run_dir_ + "/param_groups.txt", param_groups_text_);
    } catch (const checkpoint::CheckpointError& e) {
      throw checkpoint::WriteError(e.what());
    }
  }
  install_signal_handlers();
  fit_loop_->start_clock();
  try {
    each("on_fit_start", [&](Callback& cb) { cb.on_fit_start(*this, *module_); });
    if (!resumed && c.fast_dev_run == 0 && c.num_sanity_val_steps != 0 && datamodule_->val_loader()) {
      sanity_checking_ = true;
      each("on_sanity_check_start", [&](Callback& cb) { cb.on_sanity_check_start(*this, *module_); });
      eval_loop_->run(Stage::Validate, c.num_sanity_val_steps < 0 ? -1 : c.num_sanity_val_steps, true);
      each("on_sanity_check_end", [&](Callback& cb) { cb.on_sanity_check_end(*this, *module_); });
      sanity_checking_ = false;
    }
    each("on_train_start", [&](Callback& cb) { cb.on_train_start(*this, *module_); });
    // From here a first signal finishes the step in progress and saves (before: it exits at once).
    signals::set_current_step(state().global_step);
    signals::enter_training_loop(run_dir_.empty() ? "nothing (no run directory)" : run_dir_ + "/checkpoints/last.ckpt");
    fit_loop_->run();
    collector_->drain();
    if (int sig = fit_loop_->settle_stop(); sig != 0 && !run_dir_.empty()) {
      save_checkpoint(run_dir_ + "/checkpoints/last.ckpt");
      if (rank_ == 0)
        fmt::print(stderr, "\nstrobe: {} received; saved {}/checkpoints/last.ckpt at step {}\n",
                   sig == SIGINT ? "SIGINT" : "SIGTERM", run_dir_, state().global_step);
    }
    each("on_train_end", [&](Callback& cb) { cb.on_train_end(*this, *module_); });
    collector_->drain();
    each("on_fit_end", [&](Callback& cb) { cb.on_fit_end(*this, *module_); });
    each("teardown", [&](Callback& cb) { cb.teardown(*this, *module_, Stage::Fit); });
  } catch (const std::exception& e) {
    signals::leave_training_loop();
    // A callback failing here never replaces the error that ended training.
    for (auto& cb : callbacks_) {
      try {
        cb->on_exception(*this, *module_, e);
      } catch (const std::exception& inner) {
        fmt::print(stderr, "strobe: {}: on_exception failed: {}\n", cb->name(), inner.what());
      } catch (...) {
        fmt::print(stderr, "strobe: {}: on_exception failed with an exception that is not a std::exception\n", cb->name());
      }
    }
    // Data parallel: a failed collective ends this process with one line naming its cause (a dead
    // peer, when the health monitor finds one); any other error reaches the other ranks, which end
    // within trainer.dist_timeout naming it (they may be blocked in a collective this rank will never join).
    finish_mlflow("FAILED");
    if (world_size_ > 1) strategy_->abort_on_error(e);
    throw;
  }
  signals::leave_training_loop();
  strategy_->shutdown();  // every rank finished: nobody's exit is a failure any more
  // MLflow's status: a NaN stop (exit 3) or any other failure is FAILED, a signal's stop KILLED.
  const int code = fit_loop_->exit_code();
  finish_mlflow(code == kExitOk ? "FINISHED" : code >= 128 ? "KILLED" : "FAILED");
  return code;
}

void Trainer::finish_mlflow(const char* status) {
  if (!mlflow_) return;
  try {
    collector_->drain();  // the last rows (after an error the device may not answer: then without them)
  } catch (const std::exception&) {
  }
  mlflow_->finish(status);
  collector_->remove_consumer(mlflow_.get());
}

void Trainer::check_resume_world_size(const checkpoint::CheckpointData& d, const config::SavedConfig* then) {
  world_size_note_.clear();
  resume_samples_.reset();
  const std::string& source = d.source;
  const CheckpointMeta meta = CheckpointView(d, source).meta();
  const int64_t saved = meta.world_size;
  // Every rank reads the same file and takes the same branch: a refusal ends in order, then the
  // same exit 2 everywhere (docs/DISTRIBUTED.md, "Resuming on another number of processes").
  auto refuse_with = [&](const std::string& line) {
    strategy_->shutdown();
    throw checkpoint::CheckpointError(line);
  };
  auto refuse = [&](const std::string& why) {
    refuse_with(fmt::format("{}: written by {} process(es), but this run has {}: {}", source, saved, world_size_, why));
  };
  if (saved != world_size_) {
    if (meta.rank_alone)
      refuse(fmt::format("it holds rank {}'s state alone (a failed step's start or a checkpoint made on an exception), "
                         "which resumes only on the number of processes that wrote it",
                         *meta.rank_alone));
    if (then == nullptr) refuse("its saved config is missing or does not parse, so its batch cannot be read");
  }
  if (then == nullptr) return;  // the same number of processes, the batch unknown: as it is
  // The checkpoint's values from its resolved config, this run's from its own (defaults resolved).
  auto saved_number = [&](const char* key) {
    const std::string v = then->leaf(key);
    return v.empty() ? int64_t{1} : std::stoll(v);
  };
  const YAML::Node data_now = exp_.data.node();
  const int64_t b_then = saved_number("data.batch_size"), a_then = saved_number("trainer.accumulate_grad_batches");
  const int64_t b_now = data_now["batch_size"] ? data_now["batch_size"].as<int64_t>() : 1,
                a_now = exp_.trainer.accumulate_grad_batches;
  const int64_t micro_then = b_then * saved, micro_now = b_now * world_size_;  // samples a batch index takes
  if (saved == world_size_ && micro_then == micro_now) return;
  const TrainerState loop = d.has_blob(checkpoint_keys::kLoop) ? parse_loop_state(d.blob(checkpoint_keys::kLoop)) : TrainerState{};
  if (loop.batch_in_epoch % a_then != 0) {
    if (saved != world_size_) refuse("it was taken inside an accumulation window, whose gradients each rank held alone");
    refuse_with(fmt::format(
        "{}: data.batch_size {} -> {}: it was taken inside an accumulation window, whose gradients are of batches of {}; "
        "resume from a checkpoint at an optimizer step's end",
        source, b_then, b_now, b_then));
  }
  const int64_t global_then = micro_then * a_then, global_now = micro_now * a_now;
  const std::string processes =
      saved == world_size_ ? fmt::format("{} process(es)", saved) : fmt::format("{} process(es) -> {}", saved, world_size_);
  if (micro_then == micro_now) {
    // The data position carries over as it is: batch k of an epoch is the k-th global batch of the
    // epoch's permutation on any number of processes (each rank takes a stride of it).
    world_size_note_ =
        global_then == global_now
            ? fmt::format("{}, the global batch {} kept (data.batch_size {} -> {})", processes, global_now, b_then, b_now)
            : fmt::format("{}, the global batch {} -> {} (trainer.accumulate_grad_batches {} -> {}); the learning rate "
                          "is not rescaled",
                          processes, global_then, global_now, a_then, a_now);
    return;
  }
  // Another batch: the epoch goes on from the samples the checkpoint's run consumed of its order.
  const int64_t consumed = loop.epoch_done ? 0 : loop.sample_offset + loop.batch_in_epoch * micro_then;
  if (!loop.epoch_done) resume_samples_ = consumed;
  world_size_note_ = fmt::format(
      "{}, the global batch {} -> {} (data.batch_size {} x {} process(es) x trainer.accumulate_grad_batches {} -> {} x {} "
      "x {}){}; the learning rate is not rescaled",
      processes, global_then, global_now, b_then, saved, a_then, b_now, world_size_, a_now,
      loop.epoch_done ? std::string()
                      : fmt::format(", epoch {} going on after its first {} sample(s)", loop.epoch, consumed));
}

std::optional<double> Trainer::rank0_value(std::optional<double> value) {
  if (world_size_ == 1) return value;
  auto s = strategy_->broadcast_string(value ? fmt::format("{:.17g}", *value) : std::string());
  if (s.empty()) return std::nullopt;
  return std::stod(s);
}

int Trainer::validate(std::optional<checkpoint::CheckpointData> weights) { return evaluate(Stage::Validate, std::move(weights)); }

int Trainer::test(std::optional<checkpoint::CheckpointData> weights) { return evaluate(Stage::Test, std::move(weights)); }

int Trainer::evaluate(Stage stage, std::optional<checkpoint::CheckpointData> weights) {
  setup_common(stage, std::move(weights));
  eval_loop_->run(stage, -1, false);
  each("teardown", [&](Callback& cb) { cb.teardown(*this, *module_, stage); });
  strategy_->shutdown();
  return kExitOk;
}

std::vector<torch::Tensor> Trainer::predict(std::optional<checkpoint::CheckpointData> weights, Stage split, PredictSink* sink) {
  setup_common(Stage::Predict, std::move(weights));
  auto out = predict_loop_->run(split, sink);
  each("teardown", [&](Callback& cb) { cb.teardown(*this, *module_, Stage::Predict); });
  return out;
}

}  // namespace strobe
