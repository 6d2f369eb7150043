// Trainer, the state: the objects that save their own state (state_connector.h: Stateful) are
// registered with the StateConnector here, once; make_checkpoint, a resume (restore_training_state)
// and a load of weights (load_weights, validate/test), the NaN capture and replay all go through it.
// The entries that belong to no loop or step object are run_state.h's (run_state.cpp).
#include <filesystem>
#include <sstream>

#include <ATen/Context.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/resume_check.h"
#include "strobe/core/checkpoint_view.h"
#include "strobe/core/fault_points.h"
#include "strobe/core/loop_state.h"
#include "strobe/core/precision.h"
#include "strobe/core/resume_compat.h"
#include "strobe/core/run_state.h"
#include "strobe/core/rng_state.h"
#include "strobe/core/sharded_checkpoint.h"
#include "strobe/core/trainer.h"
#include "strobe/distributed/strategy.h"
#include "strobe/logging/log_collector.h"

namespace strobe {

// What exists from construction; the optimizer, scheduler, scaler and step pipeline join at
// fit's setup (register_fit_state). The connector keeps its one order either way.
void Trainer::register_state() {
  model_state_ = std::make_unique<ModelState>(*module_, masters_.get());
  rng_state_ = std::make_unique<RngState>(rank_, world_size_, device_, *strategy_);
  callback_states_ = std::make_unique<CallbackStates>(callbacks_);
  config_record_ = std::make_unique<TextRecord>(checkpoint_keys::kConfig, config_yaml_, false);
  hf_record_ = std::make_unique<TextRecord>(checkpoint_keys::kHfConfig, hf_source_config_, true);
  meta_record_ = std::make_unique<MetaRecord>(view(), exp_.trainer.precision);
  mlflow_record_ = std::make_unique<MlflowRecord>();
  connector_.add(checkpoint_keys::kModel, *model_state_);
  connector_.add(checkpoint_keys::kLoop, fit_loop_->progress_state());
  connector_.add(checkpoint_keys::kAccumulation, fit_loop_->accumulation_state());
  connector_.add(checkpoint_keys::kLogger, *collector_);
  connector_.add(checkpoint_keys::kRng, *rng_state_);
  connector_.add(checkpoint_keys::kCallbacks, *callback_states_);
  connector_.add(checkpoint_keys::kConfig, *config_record_);
  connector_.add(checkpoint_keys::kHfConfig, *hf_record_);
  connector_.add(checkpoint_keys::kMeta, *meta_record_);
  connector_.add(checkpoint_keys::kMlflow, *mlflow_record_);
}

void Trainer::register_fit_state() {
  optimizer_state_ = std::make_unique<OptimizerState>(*optimizer_, device_);
  connector_.add(checkpoint_keys::kOptimizer, *optimizer_state_);
  if (scheduler_) connector_.add(checkpoint_keys::kScheduler, *scheduler_);
  if (scaler_) connector_.add(checkpoint_keys::kScaler, *scaler_);
  connector_.add(checkpoint_keys::kStepGuard, *pipeline_);
}

ShardedCheckpoint Trainer::sharded_checkpoint() const { return ShardedCheckpoint(*strategy_, zero2_ != nullptr); }

ShardedCheckpoint::OptimizerShapes Trainer::optimizer_shapes() const {
  ShardedCheckpoint::OptimizerShapes out;
  if (!optimizer_) return out;
  for (const auto& g : optimizer_->param_groups()) {
    out.emplace_back();
    for (const auto& p : g.params()) {
      // zero2: the optimizer updates shards; their parameters' shapes are the whole ones.
      torch::Tensor whole = p;
      if (zero2_)
        for (size_t i = 0; i < zero2_->shards().size(); ++i)
          if (zero2_->shards()[i].is_same(p)) whole = zero2_->params()[i];
      out.back().push_back(whole.sizes().vec());
    }
  }
  return out;
}

checkpoint::CheckpointData Trainer::make_checkpoint() { return build_checkpoint(nullptr); }
checkpoint::CheckpointData Trainer::make_checkpoint_at(const StepStart& start) { return build_checkpoint(&start); }

checkpoint::CheckpointData Trainer::build_checkpoint(const StepStart* step_start) {
  checkpoint::CheckpointData d;
  // A local checkpoint (StepStart::local) makes no collective: the logger keeps its own sums.
  struct LocalSave {
    logging::LogCollector& c;
    ~LocalSave() { c.set_local_save(false); }
  } guard{*collector_};
  collector_->set_local_save(step_start && step_start->local);
  connector_.save(d, step_start);
  sharded_checkpoint().mark(d);  // zero2: the optimizer entry is this rank's shard of the optimizer state
  each("on_save_checkpoint", [&](Callback& cb) { cb.on_save_checkpoint(*this, *module_, d); });
  return d;
}

void Trainer::save_checkpoint(const std::string& path) {
  auto d = make_checkpoint();  // every rank: the RNG gather and the logger sums are collectives
  sharded_checkpoint().save(path, std::move(d), state().global_step);
}

namespace {
// The changes that reorder an epoch: a mix's sources and weights, and the packing plan (its switch,
// and max_seq_len while either side packs), as "key: a -> b".
std::vector<std::string> epoch_order_changes(const config::ResumeCheck& check, bool packed) {
  std::vector<std::string> out;
  for (const auto* changes : {&check.incompatible, &check.model_changes, &check.allowed})
    for (const auto& c : *changes)
      if (c.key.rfind("data.sources", 0) == 0 || c.key == "data.packing" || (packed && c.key == "data.max_seq_len"))
        out.push_back(c.text());
  return out;
}
}  // namespace

void Trainer::finish_epoch_with_its_data(const checkpoint::CheckpointData& data, const ConfigComparison& configs,
                                         const TrainerState& loop) {
  if (config_yaml_.empty() || !configs.saved) return;  // no config to compare (a program without one)
  // The config the epoch began under: the checkpoint's (compared with this run's already), or the
  // one its epoch was finishing with.
  std::shared_ptr<const config::SavedConfig> began = configs.saved;
  std::optional<config::ResumeCheck> against_epoch;
  if (data.has_blob(checkpoint_keys::kDataEpochConfig)) {
    began = std::make_shared<const config::SavedConfig>(data.blob(checkpoint_keys::kDataEpochConfig),
                                                        data.source + " (the config its epoch began under)");
    against_epoch = config::compare_for_resume(began->leaves(), config::SavedConfig(config_yaml_, "this run's config").leaves());
  }
  const config::ResumeCheck* check = against_epoch ? &*against_epoch : configs.check ? &*configs.check : nullptr;
  if (!check) return;
  const bool packed = began->leaf("data.packing") == "best_fit" || datamodule_->train_loader()->options().pack_row_len > 0;
  const auto changes = epoch_order_changes(*check, packed);
  if (changes.empty()) return;
  // That config's data section, with this run's batch and workers (a new batch size is a rebase of
  // the position, as for any resume: the epoch's order is what stays).
  auto doc = began->document();
  const auto& opt = datamodule_->train_loader()->options();
  for (const auto& [key, value] : std::vector<std::pair<std::string, int64_t>>{
           {"batch_size", opt.batch_size}, {"num_workers", opt.num_workers}, {"prefetch_factor", opt.prefetch_factor}})
    doc.apply_override(fmt::format("data.{}={}", key, value));
  DataContext ctx;
  ctx.seed = static_cast<uint64_t>(exp_.seed);
  ctx.rank = rank_;
  ctx.world_size = world_size_;
  std::shared_ptr<DataModule> earlier;
  try {
    auto root = doc.root();
    auto section = root.child("data");
    earlier = data_registry().create(section, "", ctx);
  } catch (const std::exception& e) {
    throw checkpoint::CheckpointError(fmt::format(
        "{}: {}: epoch {} is {} batch(es) in and must finish with the data it began with, which cannot be built now ({}); "
        "resume from a checkpoint at an epoch's end, or with the checkpoint's data",
        data.source, fmt::join(changes, ", "), loop.epoch, loop.batch_in_epoch, e.what()));
  }
  earlier->setup(Stage::Fit);
  auto loader = earlier->train_loader();
  fit_loop_->finish_epoch_with(loader, began->text(), earlier->info().source_names);
  epoch_data_module_ = earlier;
  data_epoch_note_ = fmt::format("{} from epoch {} (epoch {} finishes with the data it began with)", fmt::join(changes, ", "),
                                 loop.epoch + 1, loop.epoch);
}

std::vector<config::ConfigChange> Trainer::restore_training_state(const checkpoint::CheckpointData& data) {
  // The saved config against the current one, parsed once (a zero2 rank's merged shard below holds
  // the same config).
  const ConfigComparison configs = compare_configs(data, config_yaml_, checkpoint_config_);
  check_resume_world_size(data, configs.saved.get());
  const std::string& source = data.source;
  // A resume restores the whole training state: a checkpoint without its config (the compatibility
  // check), its optimizer state (fresh moments) or its loop counters would resume silently wrong.
  std::vector<std::string> lacking;
  if (!data.has_blob("config")) lacking.push_back("its config (blob 'config')");
  if (!data.has_blob(checkpoint_keys::kOptimizer) && !data.has_blob(ShardedCheckpoint::kManifestBlob))
    lacking.push_back("the optimizer state (blob 'optimizer')");
  if (!data.has_blob(checkpoint_keys::kLoop)) lacking.push_back("the loop counters (blob 'loop')");
  if (!lacking.empty())
    throw checkpoint::CheckpointError(fmt::format(
        "{}: cannot resume from it: it lacks {}; a file of weights alone is for starting a new run (strobe export it, "
        "then model.init_from)",
        source, fmt::join(lacking, ", ")));
  // Before any state is restored: the saved config against the current one (another optimizer,
  // precision or model shape is refused naming the change; the rest is returned for fit to list).
  auto changes = check_resume_compatible(source, data, configs, module_->net());
  // A mix's schedule and a packing plan are the epoch's order: another one from the middle of an
  // epoch would draw a sample twice or never. The epoch finishes with the data config it began
  // under, and this run's applies from the next epoch (docs/DATA.md, "Mixes" and "Packing").
  if (data.has_blob(checkpoint_keys::kLoop)) {
    const TrainerState loop = parse_loop_state(data.blob(checkpoint_keys::kLoop));
    if (loop.batch_in_epoch > 0 && !loop.epoch_done) finish_epoch_with_its_data(data, configs, loop);
  }
  // This rank's optimizer state: zero2's own shard, or the checkpoint's re-cut for this run's number
  // of processes and strategy (sharded_checkpoint.h).
  const std::optional<checkpoint::CheckpointData> own = sharded_checkpoint().for_resume(data, optimizer_shapes());
  const checkpoint::CheckpointData& d = own ? *own : data;
  connector_.load(d, /*restore_training_state=*/true, source);
  if (resume_samples_) fit_loop_->rebase_to_samples(*resume_samples_);
  each("on_load_checkpoint", [&](Callback& cb) { cb.on_load_checkpoint(*this, *module_, d); });
  return changes;
}

std::string Trainer::settle_schedule_length(const std::vector<config::ConfigChange>& changes) {
  if (!scheduler_ || !optimizer_ || optimizer_->param_groups().empty()) return "";
  const int64_t was = scheduler_->saved_length(), now = scheduler_->length();
  if (was < 0 || now < 0 || was == now) return "";
  // The changes of the run's length the user made on purpose, against the checkpoint's config.
  std::vector<std::string> asked;
  for (const auto& c : changes)
    if (c.key == "trainer.max_steps" || c.key == "trainer.max_epochs" || c.key == "scheduler.max_steps") asked.push_back(c.text());
  auto lr = [&] { return optimizer_->param_groups()[0].options().get_lr(); };
  const double lr_now = lr();
  scheduler_->set_length(was);
  scheduler_->apply();
  if (asked.empty())
    return fmt::format("cosine length {} kept from the checkpoint (this run's data and limits would make it {}; only a "
                       "change of trainer.max_steps, trainer.max_epochs or scheduler.max_steps changes it)",
                       was, now);
  const double lr_was = lr();
  scheduler_->set_length(now);
  scheduler_->apply();
  return fmt::format("cosine length {} -> {} ({}): lr {:.3g} -> {:.3g}; set scheduler.max_steps={} to keep it", was, now,
                     fmt::join(asked, ", "), lr_was, lr_now, was);
}

void Trainer::load_weights(const checkpoint::CheckpointData& d) {
  const std::string& source = d.source;
  // Every load of weights is strict: all names and all shapes, or refused naming the model config
  // keys that differ, else the tensors.
  const ConfigComparison configs = compare_configs(d, config_yaml_, checkpoint_config_);
  if (auto mismatch = weights_mismatch(d, configs, module_->net()); !mismatch.empty())
    throw checkpoint::CheckpointError(
        fmt::format("{}: the checkpoint's weights do not fit this model: {}{}", source, mismatch, run_config_hint(source, configs)));
  if (const std::string changed = function_changes(configs); !changed.empty() && is_global_zero()) {
    // The weights fit, but they are evaluated as another function than they were trained as.
    fmt::print(stderr, "strobe: warning: {}: evaluated with model keys that differ from the checkpoint's config: {}\n", source,
               changed);
  }
  connector_.load(d, /*restore_training_state=*/false, source);
}

}  // namespace strobe
