// FitLoop (loops.h): epochs of training batches with periodic validation, the optimizer step's
// progress, and the stop state; BatchPreparer, the loops' way onto the device.
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/core/engine_access.h"
#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/checkpoint_keys.h"
#include "strobe/config/config.h"
#include "strobe/core/fault_points.h"
#include "strobe/core/freeze.h"
#include "strobe/core/loops.h"
#include "strobe/core/optim.h"
#include "strobe/core/precision.h"
#include "strobe/core/signals.h"
#include "strobe/core/step_runner.h"
#include "strobe/data/data_error.h"
#include "strobe/data/loader.h"
#include "strobe/distributed/strategy.h"
#include "strobe/logging/log_collector.h"

namespace strobe {

Batch BatchPreparer::prepare(Batch batch, int64_t idx) {
  if (datamodule_.injected_batch() && module_.stage() == Stage::Fit && module_.training()) batch = *datamodule_.injected_batch();
  batch = datamodule_.on_before_batch_transfer(std::move(batch), idx);
  batch = transfer_(device_, [&] { return datamodule_.transfer_batch_to_device(batch, device_, idx); });
  return datamodule_.on_after_batch_transfer(std::move(batch), idx);
}

FitLoop::FitLoop(LoopParts parts, distributed::Strategy& strategy, int64_t world_size)
    : parts_(std::move(parts)), strategy_(strategy), world_size_(world_size) {}

void FitLoop::setup(std::shared_ptr<data::DataLoader> loader) {
  const auto& c = *parts_.cfg;
  loader_ = std::move(loader);
  if (parts_.datamodule) source_names_ = parts_.datamodule->info().source_names;
  EngineAccess::set_pin_memory(*loader_, parts_.device.is_cuda());
  int64_t full = loader_->num_batches();
  // Nothing to train on is refused before the first step, naming what left nothing.
  if (full == 0)
    throw data::DataError(fmt::format("the training set yields no batches ({} sample(s), batch_size {}{})",
                                      loader_->dataset().size(), loader_->options().batch_size,
                                      loader_->options().drop_last ? ", drop_last" : ""));
  const char* limited_by = "trainer.limit_train_batches";
  int64_t n = c.limit_train_batches.resolve(full);
  if (c.overfit_batches.is_count ? c.overfit_batches.count > 0 : c.overfit_batches.fraction > 0.0) {
    n = c.overfit_batches.resolve(full);
    limited_by = "trainer.overfit_batches";
    EngineAccess::set_shuffle(*loader_, false);
  }
  if (c.fast_dev_run > 0) n = std::min(full, c.fast_dev_run);
  if (n == 0)
    throw config::ConfigError(fmt::format("{}: leaves none of the {} training batches to train on (give a count >= 1 "
                                          "or a fraction > 0)",
                                          limited_by, full));
  EngineAccess::set_limit_batches(*loader_, n);
  num_batches_ = epoch_batches_ = loader_->num_batches();
  limited_batches_ = n < full ? n : -1;
}

void FitLoop::finish_epoch_with(std::shared_ptr<data::DataLoader> loader, std::string config_yaml,
                                std::vector<std::string> source_names) {
  EngineAccess::set_pin_memory(*loader, parts_.device.is_cuda());
  if (!loader_->options().shuffle) EngineAccess::set_shuffle(*loader, false);
  if (limited_batches_ >= 0) EngineAccess::set_limit_batches(*loader, limited_batches_);
  epoch_loader_ = std::move(loader);
  epoch_config_yaml_ = std::move(config_yaml);
  epoch_source_names_ = std::move(source_names);
}

TrainerState FitLoop::saved_state() const {
  TrainerState s = state_;
  if (start_time_.time_since_epoch().count() != 0)
    s.elapsed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count();
  return s;
}

int64_t FitLoop::estimated_stepping_batches() const {
  const auto& c = *parts_.cfg;
  int64_t per_epoch = (num_batches_ + c.accumulate_grad_batches - 1) / c.accumulate_grad_batches;
  int64_t by_epochs = c.max_epochs >= 0 ? per_epoch * c.max_epochs : -1;
  if (c.max_steps >= 0) return by_epochs >= 0 ? std::min(by_epochs, c.max_steps) : c.max_steps;
  return by_epochs;
}

bool FitLoop::should_validate_now(int64_t batch_in_epoch, bool epoch_end) const {
  const auto& c = *parts_.cfg;
  if (!evaluation_ || c.fast_dev_run < 0) return false;
  if (evaluation_->planned_batches(Stage::Validate, -1) == 0) return false;
  // By time: only when due, never at an epoch's end. One process reads its clock here, after the
  // step's hooks; data parallel, the ranks' agreement of the step's end (share_stop_code) decides.
  if (c.val_check_interval_s) return world_size_ == 1 ? accum_count_ == 0 && local_validation_due() != 0 : validation_due_;
  if (c.val_check_interval.is_count) return batch_in_epoch % c.val_check_interval.count == 0;
  if ((state_.epoch + 1) % c.check_val_every_n_epoch != 0) return false;
  int64_t every = std::max<int64_t>(1, static_cast<int64_t>(c.val_check_interval.fraction * num_batches_));
  if (c.val_check_interval.fraction >= 1.0) return epoch_end;
  return batch_in_epoch % every == 0 || epoch_end;
}

double FitLoop::training_clock_s() const {
  if (start_time_.time_since_epoch().count() == 0) return state_.elapsed_s;
  return state_.elapsed_s + std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count();
}

bool FitLoop::time_is_up() const {
  const auto& c = *parts_.cfg;
  if (!c.max_time_s) return false;
  return training_clock_s() >= *c.max_time_s;
}

int FitLoop::local_validation_due() const {
  const auto& c = *parts_.cfg;
  if (!c.val_check_interval_s) return 0;
  return training_clock_s() - val_clock_s_ >= *c.val_check_interval_s ? static_cast<int>(time_validations_ + 1) : 0;
}

bool FitLoop::done() const {
  const auto& c = *parts_.cfg;
  if (world_size_ > 1) {
    // Rank-local reasons (a signal, a callback's request, the clock) count once every rank knows
    // them: the agreed code, the same at the same step everywhere.
    if (agreed_stop_ != 0) return true;
  } else {
    if (should_stop_ || signals::received() != 0) return true;
    if (time_is_up()) return true;
  }
  if (c.max_steps >= 0 && state_.global_step >= c.max_steps) return true;
  if (c.fast_dev_run > 0 && state_.epoch_done) return true;
  if (c.max_epochs >= 0 && state_.epoch_done && state_.epoch + 1 >= c.max_epochs) return true;
  return false;
}

void FitLoop::request_stop(int exit_code) {
  should_stop_ = true;
  if (exit_code != kExitOk) stop_code_ = exit_code;
}

int FitLoop::local_stop_code() const {
  if (int sig = signals::received()) return 128 + sig;
  if (should_stop_) return stop_code_ != kExitOk ? stop_code_ : 1;
  return time_is_up() ? 1 : 0;
}

void FitLoop::share_stop_code(bool blocking) {
  if (world_size_ == 1) return;
  constexpr size_t kStopLag = 2;
  torch::NoGradGuard ng;
  // [this rank's stop code, the validation by time it finds due (its number; 0: none)], max-reduced;
  // filled on the device (two fill kernels, no host-to-device copy that would wait for the stream).
  auto flag = torch::full({2}, local_stop_code(), torch::TensorOptions().dtype(torch::kInt32).device(parts_.device));
  flag.narrow(0, 1, 1).fill_(local_validation_due());
  strategy_.reduce_max(flag, distributed::CollectiveKind::kStopAgreement);
  pending_stops_.emplace_back();
  pending_stops_.back().start(flag);
  // The lag is counted in calls, which happen at the same points on every rank: every rank reads the
  // same agreed values at the same call, so all validate (or stop) after the same step. A due flag
  // read after its validation ran (it was sent again while in flight) is one of an earlier number.
  while (!pending_stops_.empty() && (blocking || pending_stops_.size() > kStopLag)) {
    const auto agreed = pending_stops_.front().wait();
    agreed_stop_ = std::max(agreed_stop_, agreed[0].item<int>());
    if (agreed[1].item<int>() == time_validations_ + 1) validation_due_ = true;
    pending_stops_.pop_front();
  }
}

int FitLoop::settle_stop() {
  // Data parallel: the agreed code (a NaN stop or a signal on any rank stops every rank with its status).
  if (world_size_ > 1 && agreed_stop_ > 1) stop_code_ = agreed_stop_;
  const int sig = world_size_ > 1 ? (agreed_stop_ >= 128 ? agreed_stop_ - 128 : 0) : signals::received();
  if (sig != 0) stop_code_ = 128 + sig;
  return sig;
}

void FitLoop::run() {
  while (!done()) {
    if (state_.epoch_done) {
      ++state_.epoch;
      state_.batch_in_epoch = 0;
      state_.sample_offset = 0;
      state_.epoch_done = false;
    }
    run_epoch();
  }
}

void FitLoop::run_epoch() {
  auto& t = *parts_.view;
  auto& module = *parts_.module;
  const bool fresh_epoch = state_.batch_in_epoch == 0 && state_.sample_offset == 0;
  // A resumed epoch that finishes with the data config it began under (finish_epoch_with).
  if (fresh_epoch && epoch_loader_) epoch_loader_.reset(), epoch_config_yaml_.clear(), epoch_source_names_.clear();
  data::DataLoader& loader = epoch_loader_ ? *epoch_loader_ : *loader_;
  if (restored_exclude_) {
    // Resumed mid-epoch with another data.exclude: the epoch finishes with the order it began with
    // (the checkpoint's exclusion); this run's applies from the next epoch.
    if (!fresh_epoch && *restored_exclude_ != loader.excluded(state_.epoch)) {
      EngineAccess::exclude_from(loader, state_.epoch + 1, *restored_exclude_);
      if (&loader != loader_.get()) EngineAccess::exclude_from(*loader_, state_.epoch + 1, *restored_exclude_);
      if (parts_.global_zero)
        fmt::print(stderr, "data.exclude: {} sample(s) of the training data left out from epoch {} on (resumed mid-way through epoch {})\n",
                   loader.excluded(state_.epoch + 1).size(), state_.epoch + 1, state_.epoch);
    }
    restored_exclude_.reset();
  }
  loader.start(state_.epoch, state_.batch_in_epoch, state_.sample_offset);
  num_batches_ = &loader == loader_.get() ? epoch_batches_ : loader.num_batches();
  if (state_.sample_offset > 0) {
    // Rebased (rebase_to_samples): the rest of the epoch's order in the new batches, and a limit
    // keeps counting the epoch's batches of the new size from its start.
    num_batches_ = loader.num_batches();
    if (limited_batches_ >= 0) {
      const int64_t per_batch = loader.options().batch_size * world_size_;
      num_batches_ = std::min(num_batches_, std::max<int64_t>(0, limited_batches_ - (state_.sample_offset + per_batch - 1) / per_batch));
    }
  }
  module.net().train();
  if (freeze_) freeze_->update(state_.epoch);
  if (fresh_epoch) {
    module.on_train_epoch_start();
    parts_.each("on_train_epoch_start", [&](Callback& cb) { cb.on_train_epoch_start(t, module); });
  }
  auto end_epoch = [&] {
    module.on_train_epoch_end();
    parts_.collector->set_training(true);
    parts_.collector->end_epoch(state_.global_step, state_.epoch, false);
    parts_.each("on_train_epoch_end", [&](Callback& cb) { cb.on_train_epoch_end(t, module); });
  };
  if (num_batches_ == 0) {  // rebased at the end of its order (the new batch leaves no whole batch there)
    state_.epoch_done = true;
    end_epoch();
    loader.stop();
    share_stop_code(/*blocking=*/true);
    return;
  }
  for (;;) {
    const auto wait_start = std::chrono::steady_clock::now();
    auto b = loader.next();
    last_input_wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
    if (!b) break;
    const int64_t idx = state_.batch_in_epoch;
    signals::set_current_step(state_.global_step + 1);  // the step a stop signal's message names
    // A signal answered with "finishing step <global_step>" (the step before this one) stops here:
    // the batch is not consumed, so a resume starts with it. (Data parallel: done() below, agreed.)
    if (world_size_ == 1 && accum_count_ == 0 && signals::received() != 0 &&
        signals::announced_step() <= state_.global_step)
      break;
    const Batch host_batch = *b;  // tensor handles only: the hooks after the step see the batch
    torch::Tensor loss = run_batch(std::move(*b), idx);
    ++state_.batch_in_epoch;
    ++state_.batches_seen;
    const bool last = state_.batch_in_epoch >= num_batches_;
    if (last) state_.epoch_done = true;
    // The end of a step, in this order (docs/ARCHITECTURE.md): the batch hooks, the validation it
    // triggers, the epoch's end, and only then the checkpoints, which thus hold everything it logged.
    parts_.each("on_train_batch_end", [&](Callback& cb) { cb.on_train_batch_end(t, module, loss, host_batch, idx); });
    fault_point("before_validation", state_.global_step);
    if (should_validate_now(state_.batch_in_epoch, last)) {
      evaluation_->run(Stage::Validate, -1, false);
      module.net().train();
      if (parts_.cfg->val_check_interval_s) {
        val_clock_s_ = training_clock_s();
        ++time_validations_;
        validation_due_ = false;
      }
    }
    if (last) end_epoch();
    fault_point("before_checkpoint", state_.global_step);
    parts_.each("on_train_batch_complete", [&](Callback& cb) { cb.on_train_batch_complete(t, module); });
    fault_point("after_checkpoint", state_.global_step);
    if (last) break;
    if (accum_count_ == 0 && done()) break;
  }
  // After an epoch that another follows, the training loader keeps its workers: they are making the
  // next epoch's first batches, which its start takes over (strobe/data/loader.h). Otherwise (a stop,
  // the last epoch, a resumed epoch's own loader) they stop here.
  if (!(state_.epoch_done && !done() && &loader == loader_.get())) loader.stop();
  share_stop_code(/*blocking=*/true);  // every rank leaves the epoch here: agree on stopping now
}

int64_t FitLoop::forward_over_training_data(int64_t epoch) {
  if (!loader_) throw std::logic_error("FitLoop::forward_over_training_data before setup");
  auto& module = *parts_.module;
  torch::NoGradGuard no_grad;
  int64_t ran = 0;
  loader_->start(epoch, 0, 0);
  while (auto b = loader_->next()) {
    Batch batch = parts_.prepare(std::move(*b), 0);
    AutocastGuard ac(parts_.device, parts_.cfg->precision);
    module.predict_step(batch, ran++);
  }
  loader_->stop();
  return ran;
}

torch::Tensor FitLoop::run_batch(Batch host_batch, int64_t batch_idx) {
  if (!runner_) throw std::logic_error("FitLoop::run_batch without a runner (set_runner)");
  auto& t = *parts_.view;
  auto& module = *parts_.module;
  if (freeze_) freeze_->update(state_.epoch);
  EngineAccess::attach(module, parts_.collector, Stage::Fit, true);
  parts_.collector->set_training(true);
  parts_.each("on_train_batch_start", [&](Callback& cb) { cb.on_train_batch_start(t, module, host_batch, batch_idx); });
  MicroBatch mb;
  mb.index = batch_idx;
  mb.first = accum_count_ == 0;
  mb.epoch_last = batch_idx + 1 >= num_batches_;
  mb.last = accum_count_ + 1 >= parts_.cfg->accumulate_grad_batches || mb.epoch_last;
  Batch batch = parts_.prepare(std::move(host_batch), 0);
  log_source_shares(batch);
  torch::Tensor loss = runner_->run(std::move(batch), mb);
  ++accum_count_;
  if (mb.last) finish_optimizer_step();
  return loss;
}

void FitLoop::log_source_shares(const Batch& batch) {
  // A mix of sources: each source's share of the batch's real tokens, on the device (no host read).
  const auto& names = epoch_loader_ ? epoch_source_names_ : source_names_;  // the epoch's own sources
  if (names.empty()) return;
  const auto source = batch.tensors.find("source"), lengths = batch.tensors.find("lengths");
  if (source == batch.tensors.end() || lengths == batch.tensors.end()) return;
  torch::NoGradGuard ng;
  const auto n = lengths->second.to(torch::kFloat32);
  auto counts = torch::zeros({static_cast<int64_t>(names.size())}, n.options()).index_add_(0, source->second, n);
  const auto shares = counts / counts.sum().clamp_min(1.0);
  const int64_t b = batch.meta.count("batch_size") ? batch.meta.at("batch_size") : 1;
  for (size_t s = 0; s < names.size(); ++s)
    parts_.collector->log("train/tokens/" + names[s], shares[static_cast<int64_t>(s)], LogOptions{true, false, false}, b);
}

void FitLoop::finish_optimizer_step() {
  auto& t = *parts_.view;
  if (optimizer_)
    parts_.each("on_before_zero_grad", [&](Callback& cb) { cb.on_before_zero_grad(t, *parts_.module, *optimizer_); });
  runner_->zero_grad();
  accum_count_ = 0;
  ++state_.global_step;
  if (scheduler_) scheduler_->step(state_.global_step);
  const bool emit = state_.global_step % parts_.cfg->log_every_n_steps == 0 || state_.global_step == 1;
  parts_.collector->end_step(state_.global_step, state_.epoch, emit);
  share_stop_code(/*blocking=*/false);
}

void FitLoop::Progress::save(checkpoint::CheckpointData& d, const StepStart* at) {
  const auto s = at ? at->loop : loop_.saved_state();
  d.blobs[checkpoint_keys::kLoop] = serialize_loop_state(s);
  // The training data's exclusion (data.exclude) in the saved epoch: a resume with another one
  // keeps this one until the epoch ends.
  const data::DataLoader* epoch_loader = loop_.epoch_loader_ ? loop_.epoch_loader_.get() : loop_.loader_.get();
  if (epoch_loader && !epoch_loader->excluded(s.epoch).empty())
    d.blobs[checkpoint_keys::kDataExclude] = nlohmann::json(epoch_loader->excluded(s.epoch)).dump();
  // An epoch finishing with the data config it began under: the resume that takes it up needs it.
  if (loop_.epoch_loader_ && !s.epoch_done) d.blobs[checkpoint_keys::kDataEpochConfig] = loop_.epoch_config_yaml_;
  // Validation by time: the clock since the last validation carries over a resume, as max_time's does.
  if (loop_.parts_.cfg->val_check_interval_s)
    d.blobs[checkpoint_keys::kValClock] =
        nlohmann::json{{"since_s", std::max(0.0, s.elapsed_s - loop_.val_clock_s_)}, {"count", loop_.time_validations_}}.dump();
}

void FitLoop::Progress::load(const checkpoint::CheckpointData& d) {
  loop_.state_ = parse_loop_state(d.blob(checkpoint_keys::kLoop));
  loop_.val_clock_s_ = loop_.state_.elapsed_s;  // a checkpoint without the record: the interval starts at the resume
  loop_.time_validations_ = 0;
  if (d.has_blob(checkpoint_keys::kValClock)) {
    const auto j = nlohmann::json::parse(d.blob(checkpoint_keys::kValClock), nullptr, false);
    if (!j.is_object() || !j.contains("since_s") || !j["since_s"].is_number() || !j.contains("count") || !j["count"].is_number_integer())
      throw checkpoint::CheckpointError("the loop's val_clock record is not {\"since_s\": seconds, \"count\": validations}");
    loop_.val_clock_s_ = loop_.state_.elapsed_s - j["since_s"].get<double>();
    loop_.time_validations_ = j["count"].get<int64_t>();
  }
  loop_.restored_exclude_ = std::vector<int64_t>{};
  if (d.has_blob(checkpoint_keys::kDataExclude)) {
    const auto j = nlohmann::json::parse(d.blob(checkpoint_keys::kDataExclude), nullptr, false);
    if (!j.is_array()) throw checkpoint::CheckpointError("the loop's data_exclude record is not a JSON list");
    for (const auto& v : j) {
      if (!v.is_number_integer()) throw checkpoint::CheckpointError("the loop's data_exclude record holds a non-index");
      loop_.restored_exclude_->push_back(v.get<int64_t>());
    }
  }
}

void FitLoop::Accumulation::save(checkpoint::CheckpointData& d, const StepStart* at) {
  const int64_t micro_batches = at ? 0 : loop_.accum_count_;  // a step starts with no partial window
  d.blobs[checkpoint_keys::kAccumulation] = nlohmann::json{{"micro_batches", micro_batches}}.dump();
  if (micro_batches == 0) return;
  for (const auto& p : loop_.parts_.module->net().named_parameters())
    if (p.value().grad().defined()) d.tensors[checkpoint_keys::kAccumulationGradPrefix + p.key()] = p.value().grad();
}

void FitLoop::Accumulation::load(const checkpoint::CheckpointData& d) {
  loop_.accum_count_ =
      d.has_blob(checkpoint_keys::kAccumulation) ? nlohmann::json::parse(d.blob(checkpoint_keys::kAccumulation)).at("micro_batches").get<int64_t>() : 0;
  for (auto& p : loop_.parts_.module->net().named_parameters()) {
    auto it = d.tensors.find(checkpoint_keys::kAccumulationGradPrefix + p.key());
    if (loop_.accum_count_ > 0 && it != d.tensors.end())
      p.value().mutable_grad() = it->second.to(p.value().device()).clone();
    else
      p.value().mutable_grad() = torch::Tensor();
  }
}

}  // namespace strobe
