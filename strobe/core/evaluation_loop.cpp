// EvaluationLoop (loops.h): one validation or test run; PredictLoop: one prediction run.
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/engine_access.h"
#include "strobe/core/loops.h"
#include "strobe/core/optim.h"
#include "strobe/core/precision.h"
#include "strobe/logging/log_collector.h"

namespace strobe {

EvaluationLoop::EvaluationLoop(LoopParts parts, TrainerState& state) : parts_(std::move(parts)), state_(state) {}

std::shared_ptr<data::DataLoader> EvaluationLoop::loader_of(Stage stage) const {
  return stage == Stage::Validate ? parts_.datamodule->val_loader() : parts_.datamodule->test_loader();
}

int64_t EvaluationLoop::planned_batches(Stage stage, int64_t limit) const {
  auto loader = loader_of(stage);
  if (!loader) return 0;
  const auto& c = *parts_.cfg;
  int64_t n = (stage == Stage::Validate ? c.limit_val_batches : c.limit_test_batches).resolve(loader->num_batches());
  if (c.fast_dev_run > 0) n = std::min(n, c.fast_dev_run);
  if (limit >= 0) n = std::min(n, limit);
  return n;
}

int64_t EvaluationLoop::run(Stage stage, int64_t limit, bool sanity) {
  auto loader = loader_of(stage);
  if (!loader) return 0;
  EngineAccess::set_pin_memory(*loader, parts_.device.is_cuda());
  EngineAccess::set_limit_batches(*loader, -1);
  const int64_t n = planned_batches(stage, limit);
  if (n == 0) return 0;
  auto& t = *parts_.view;
  auto& module = *parts_.module;
  auto& collector = *parts_.collector;
  const bool was_training = module.net().is_training();
  module.net().eval();
  collector.set_training(false);
  EngineAccess::attach(module, &collector, stage, false);
  torch::NoGradGuard no_grad;
  const bool val = stage == Stage::Validate;
  if (val) {
    parts_.each("on_validation_start", [&](Callback& cb) { cb.on_validation_start(t, module); });
    module.on_validation_epoch_start();
    parts_.each("on_validation_epoch_start", [&](Callback& cb) { cb.on_validation_epoch_start(t, module); });
  } else {
    parts_.each("on_test_start", [&](Callback& cb) { cb.on_test_start(t, module); });
    parts_.each("on_test_epoch_start", [&](Callback& cb) { cb.on_test_epoch_start(t, module); });
  }
  int64_t ran = 0;
  loader->start(0, 0);
  for (int64_t i = 0; i < n; ++i) {
    auto b = loader->next();
    if (!b) break;
    if (val)
      parts_.each("on_validation_batch_start", [&](Callback& cb) { cb.on_validation_batch_start(t, module, *b, i); });
    else
      parts_.each("on_test_batch_start", [&](Callback& cb) { cb.on_test_batch_start(t, module, *b, i); });
    Batch batch = parts_.prepare(std::move(*b), 0);
    EngineAccess::set_current_batch_size(module, batch.batch_size());
    {
      AutocastGuard ac(parts_.device, parts_.cfg->precision);
      if (val)
        module.validation_step(batch, i);
      else
        module.test_step(batch, i);
    }
    if (val)
      parts_.each("on_validation_batch_end", [&](Callback& cb) { cb.on_validation_batch_end(t, module, batch, i); });
    else
      parts_.each("on_test_batch_end", [&](Callback& cb) { cb.on_test_batch_end(t, module, batch, i); });
    ++ran;
  }
  loader->stop();
  if (val) {
    module.on_validation_epoch_end();
  } else {
    module.on_test_epoch_end();
  }
  if (sanity) {
    collector.discard_epoch();
  } else {
    collector.end_epoch(state_.global_step, state_.epoch, /*wait=*/true);
  }
  if (val) {
    if (!sanity) ++state_.val_runs;
    parts_.each("on_validation_epoch_end", [&](Callback& cb) { cb.on_validation_epoch_end(t, module); });
    if (!sanity && scheduler_ && scheduler_->wants_monitor()) {
      const auto& metrics = collector.latest();
      auto it = metrics.find(scheduler_->monitor());
      if (it == metrics.end())
        throw std::runtime_error(fmt::format("scheduler.monitor: '{}' was not logged during validation", scheduler_->monitor()));
      scheduler_->on_validation_end(it->second);
    }
    parts_.each("on_validation_end", [&](Callback& cb) { cb.on_validation_end(t, module); });
  } else {
    parts_.each("on_test_epoch_end", [&](Callback& cb) { cb.on_test_epoch_end(t, module); });
    parts_.each("on_test_end", [&](Callback& cb) { cb.on_test_end(t, module); });
  }
  collector.set_training(true);
  EngineAccess::attach(module, &collector, Stage::Fit, true);
  if (was_training) module.net().train();
  return ran;
}

std::vector<torch::Tensor> PredictLoop::run(Stage split, PredictSink* sink) {
  auto& t = *parts_.view;
  auto& module = *parts_.module;
  auto loader = split == Stage::Validate ? parts_.datamodule->val_loader() : parts_.datamodule->predict_loader();
  std::vector<torch::Tensor> out;
  if (!loader) return out;
  EngineAccess::set_limit_batches(*loader, -1);
  const int64_t n = parts_.cfg->limit_predict_batches.resolve(loader->num_batches());
  module.net().eval();
  EngineAccess::attach(module, parts_.collector, Stage::Predict, false);
  torch::NoGradGuard ng;
  parts_.each("on_predict_start", [&](Callback& cb) { cb.on_predict_start(t, module); });
  parts_.each("on_predict_epoch_start", [&](Callback& cb) { cb.on_predict_epoch_start(t, module); });
  loader->start(0, 0);
  for (int64_t i = 0; i < n; ++i) {
    auto b = loader->next();
    if (!b) break;
    parts_.each("on_predict_batch_start", [&](Callback& cb) { cb.on_predict_batch_start(t, module, *b, i); });
    const std::vector<int64_t> indices = b->indices;  // the host batch's: a data hook may build a new batch
    Batch batch = parts_.prepare(std::move(*b), 0);
    torch::Tensor y;
    {
      AutocastGuard ac(parts_.device, parts_.cfg->precision);
      y = module.predict_step(batch, i);
    }
    parts_.each("on_predict_batch_end", [&](Callback& cb) { cb.on_predict_batch_end(t, module, y, batch, i); });
    if (sink)
      sink->consume(batch, indices, y, loader->dataset());
    else
      out.push_back(y.to(torch::kCPU));
  }
  loader->stop();
  parts_.each("on_predict_epoch_end", [&](Callback& cb) { cb.on_predict_epoch_end(t, module); });
  parts_.each("on_predict_end", [&](Callback& cb) { cb.on_predict_end(t, module); });
  return out;
}

}  // namespace strobe
