// Trainer, the loops: epochs of training batches with periodic validation, and evaluation runs.
#include <fmt/format.h>
#include <torch/torch.h>

#include "framework/core/fault_points.h"
#include "framework/core/precision.h"
#include "framework/core/signals.h"
#include "framework/core/trainer.h"
#include "framework/distributed/strategy.h"
#include "framework/logging/log_collector.h"

namespace strobe {

Batch Trainer::prepare_batch(Batch batch, int64_t idx) {
  if (datamodule_->injected_batch() && module_->stage() == Stage::Fit && module_->training()) batch = *datamodule_->injected_batch();
  batch = datamodule_->on_before_batch_transfer(std::move(batch), idx);
  batch = transfer_(device_, [&] { return datamodule_->transfer_batch_to_device(batch, device_, idx); });
  return datamodule_->on_after_batch_transfer(std::move(batch), idx);
}

bool Trainer::should_validate_now(int64_t batch_in_epoch, bool epoch_end) const {
  const auto& c = exp_.trainer;
  auto loader = datamodule_->val_loader();
  if (!loader || c.fast_dev_run < 0) return false;
  if (c.limit_val_batches.resolve(loader->num_batches()) == 0) return false;
  if (c.val_check_interval.is_count) return batch_in_epoch % c.val_check_interval.count == 0;
  if ((state_.epoch + 1) % c.check_val_every_n_epoch != 0) return false;
  int64_t every = std::max<int64_t>(1, static_cast<int64_t>(c.val_check_interval.fraction * num_train_batches_));
  if (c.val_check_interval.fraction >= 1.0) return epoch_end;
  return batch_in_epoch % every == 0 || epoch_end;
}

bool Trainer::time_is_up() const {
  const auto& c = exp_.trainer;
  if (!c.max_time_s) return false;
  double elapsed = state_.elapsed_s + std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count();
  return elapsed >= *c.max_time_s;
}

bool Trainer::done() const {
  const auto& c = exp_.trainer;
  if (world_size_ > 1) {
    // Rank-local reasons (a signal, a callback's request, the clock) count once every rank knows
    // them: the agreed code, the same at the same step everywhere.
    if (agreed_stop_ != 0) return true;
  } else {
    if (should_stop_ || received_stop_signal() != 0) return true;
    if (time_is_up()) return true;
  }
  if (c.max_steps >= 0 && state_.global_step >= c.max_steps) return true;
  if (c.fast_dev_run > 0 && state_.epoch_done) return true;
  if (c.max_epochs >= 0 && state_.epoch_done && state_.epoch + 1 >= c.max_epochs) return true;
  return false;
}

int Trainer::local_stop_code() const {
  if (int sig = received_stop_signal()) return 128 + sig;
  if (should_stop_) return stop_code_ != kExitOk ? stop_code_ : 1;
  return time_is_up() ? 1 : 0;
}

void Trainer::share_stop_code(bool blocking) {
  if (world_size_ == 1) return;
  constexpr size_t kStopLag = 2;
  torch::NoGradGuard ng;
  auto flag = torch::full({}, local_stop_code(), torch::TensorOptions().dtype(torch::kInt32).device(device_));
  strategy_->reduce_max(flag);
  pending_stops_.emplace_back();
  pending_stops_.back().start(flag);
  // The lag is counted in calls, which happen at the same points on every rank.
  while (!pending_stops_.empty() && (blocking || pending_stops_.size() > kStopLag)) {
    agreed_stop_ = std::max(agreed_stop_, pending_stops_.front().wait().item<int>());
    pending_stops_.pop_front();
  }
}

void Trainer::train_epoch() {
  const bool fresh_epoch = state_.batch_in_epoch == 0;
  train_loader_->start(state_.epoch, state_.batch_in_epoch);
  module_->net().train();
  if (fresh_epoch) {
    module_->on_train_epoch_start();
    each([&](Callback& cb) { cb.on_train_epoch_start(*this, *module_); });
  }
  for (;;) {
    const auto wait_start = std::chrono::steady_clock::now();
    auto b = train_loader_->next();
    last_input_wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
    if (!b) break;
    const int64_t idx = state_.batch_in_epoch;
    signals::set_current_step(state_.global_step + 1);  // the step a stop signal's message names
    // A signal answered with "finishing step <global_step>" (the step before this one) stops here:
    // the batch is not consumed, so a resume starts with it. (Data parallel: done() below, agreed.)
    if (world_size_ == 1 && accum_count_ == 0 && signals::received() != 0 && signals::announced_step() <= state_.global_step)
      break;
    const Batch host_batch = *b;  // tensor handles only: the hooks after the step see the batch
    torch::Tensor loss = run_training_batch(std::move(*b), idx);
    ++state_.batch_in_epoch;
    ++state_.batches_seen;
    const bool last = state_.batch_in_epoch >= num_train_batches_;
    if (last) state_.epoch_done = true;
    // The end of a step, in this order (docs/ARCHITECTURE.md): the batch hooks, the validation it
    // triggers, the epoch's end, and only then the checkpoints, which thus hold everything it logged.
    each([&](Callback& cb) { cb.on_train_batch_end(*this, *module_, loss, host_batch, idx); });
    fault_point("before_validation", state_.global_step);
    if (should_validate_now(state_.batch_in_epoch, last)) {
      run_eval(Stage::Validate, -1, false);
      module_->net().train();
    }
    if (last) {
      module_->on_train_epoch_end();
      collector_->set_training(true);
      collector_->end_epoch(state_.global_step, state_.epoch, false);
      each([&](Callback& cb) { cb.on_train_epoch_end(*this, *module_); });
    }
    fault_point("before_checkpoint", state_.global_step);
    each([&](Callback& cb) { cb.on_train_batch_complete(*this, *module_); });
    fault_point("after_checkpoint", state_.global_step);
    if (last) break;
    if (accum_count_ == 0 && done()) break;
  }
  train_loader_->stop();
  share_stop_code(/*blocking=*/true);  // every rank leaves the epoch here: agree on stopping now
}

void Trainer::run_eval(Stage stage, int64_t limit, bool sanity) {
  auto loader = stage == Stage::Validate ? datamodule_->val_loader() : datamodule_->test_loader();
  if (!loader) return;
  loader->set_pin_memory(device_.is_cuda());
  const auto& c = exp_.trainer;
  loader->set_limit_batches(-1);
  int64_t n = (stage == Stage::Validate ? c.limit_val_batches : c.limit_test_batches).resolve(loader->num_batches());
  if (c.fast_dev_run > 0) n = std::min(n, c.fast_dev_run);
  if (limit >= 0) n = std::min(n, limit);
  if (n == 0) return;
  const bool was_training = module_->net().is_training();
  module_->net().eval();
  collector_->set_training(false);
  module_->attach(collector_.get(), stage, false);
  torch::NoGradGuard no_grad;
  const bool val = stage == Stage::Validate;
  if (val) {
    each([&](Callback& cb) { cb.on_validation_start(*this, *module_); });
    module_->on_validation_epoch_start();
    each([&](Callback& cb) { cb.on_validation_epoch_start(*this, *module_); });
  } else {
    each([&](Callback& cb) { cb.on_test_start(*this, *module_); });
    each([&](Callback& cb) { cb.on_test_epoch_start(*this, *module_); });
  }
  loader->start(0, 0);
  for (int64_t i = 0; i < n; ++i) {
    auto b = loader->next();
    if (!b) break;
    if (val)
      each([&](Callback& cb) { cb.on_validation_batch_start(*this, *module_, *b, i); });
    else
      each([&](Callback& cb) { cb.on_test_batch_start(*this, *module_, *b, i); });
    Batch batch = prepare_batch(std::move(*b), 0);
    module_->set_current_batch_size(batch.batch_size());
    {
      AutocastGuard ac(device_, c.precision);
      if (val)
        module_->validation_step(batch, i);
      else
        module_->test_step(batch, i);
    }
    if (val)
      each([&](Callback& cb) { cb.on_validation_batch_end(*this, *module_, batch, i); });
    else
      each([&](Callback& cb) { cb.on_test_batch_end(*this, *module_, batch, i); });
  }
  loader->stop();
  if (val) {
    module_->on_validation_epoch_end();
  } else {
    module_->on_test_epoch_end();
  }
  if (sanity) {
    collector_->discard_epoch();
  } else {
    collector_->end_epoch(state_.global_step, state_.epoch, /*wait=*/true);
  }
  if (val) {
    if (!sanity) ++state_.val_runs;
    each([&](Callback& cb) { cb.on_validation_epoch_end(*this, *module_); });
    if (!sanity && scheduler_ && scheduler_->wants_monitor()) {
      auto it = metrics().find(scheduler_->monitor());
      if (it == metrics().end())
        throw std::runtime_error(fmt::format("scheduler.monitor: '{}' was not logged during validation", scheduler_->monitor()));
      scheduler_->on_validation_end(it->second);
    }
    each([&](Callback& cb) { cb.on_validation_end(*this, *module_); });
  } else {
    each([&](Callback& cb) { cb.on_test_epoch_end(*this, *module_); });
    each([&](Callback& cb) { cb.on_test_end(*this, *module_); });
  }
  collector_->set_training(true);
  module_->attach(collector_.get(), Stage::Fit, true);
  if (was_training) module_->net().train();
}

}  // namespace strobe
