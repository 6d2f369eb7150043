// Module (LightningModule): what a step computes. Built from `task:` + `model:`; the trainer owns
// the loops, devices, precision and optimizer stepping; the module returns the loss and logs.
//
// Logging: log(name, value) takes a device tensor and never reads it on the host. Training steps log
// per step by default; validation/test steps log per epoch (a device-side mean weighted by the batch
// size), as in Lightning.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "strobe/config/registry.h"
#include "strobe/core/datamodule.h"
#include "strobe/core/model.h"
#include "strobe/data/batch.h"
#include "strobe/logging/log_sink.h"

namespace strobe {

namespace metrics {
class MetricCollection;
}

class LRScheduler;
struct EngineAccess;

struct OptimizerSetup {
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  std::shared_ptr<LRScheduler> scheduler;  // may be null
};

class Module {
 public:
  virtual ~Module() = default;

  // The trainable network (parameters, buffers, train/eval, device moves, checkpoints).
  virtual torch::nn::Module& net() = 0;

  virtual torch::Tensor training_step(const Batch& batch, int64_t batch_idx) = 0;
  virtual void validation_step(const Batch& /*batch*/, int64_t /*batch_idx*/) {}
  virtual void test_step(const Batch& batch, int64_t batch_idx) { validation_step(batch, batch_idx); }
  virtual torch::Tensor predict_step(const Batch& batch, int64_t batch_idx);

  // The batch keys the task reads besides its model's ({"label"}, {"targets"}); empty: not declared
  // (checked as Model::batch_keys is).
  virtual std::vector<std::string> batch_keys() const { return {}; }

  // Empty optimizer: the trainer builds one from the `optimizer:`/`scheduler:` config sections.
  virtual OptimizerSetup configure_optimizers() { return {}; }

  virtual void on_train_epoch_start() {}
  virtual void on_train_epoch_end() {}
  virtual void on_validation_epoch_start() {}
  virtual void on_validation_epoch_end() {}
  virtual void on_test_epoch_end() {}

  // The run's data (its data module's DataInfo), once, when the run is built, before any step: a
  // task may name what it logs by it (language_modeling: a mix's sources, docs/DATA.md "Mixes").
  virtual void on_data_info(const DataInfo& /*info*/) {}

  void log(const std::string& name, const torch::Tensor& value, const LogOptions& options = {});
  // The same with `weight` (the samples the value is over) in place of the batch size in the epoch's
  // weighted mean.
  void log(const std::string& name, const torch::Tensor& value, const LogOptions& options, int64_t weight);

  // Call before a metric collection's compute(): under data parallel it all-reduces the states of
  // every rank (set by the trainer from its strategy), so the value is the one of the whole data;
  // with one process it does nothing.
  void sync_metrics(metrics::MetricCollection& collection) {
    if (metric_sync_) metric_sync_(collection);
  }
  bool training() const { return training_; }
  Stage stage() const { return stage_; }

 private:
  // Set by the trainer (strobe/core/engine_access.h): where log() goes, the batch size it weights
  // epoch means by, and the data-parallel metric sync.
  friend struct EngineAccess;
  void attach(LogSink* sink, Stage stage, bool training) { sink_ = sink, stage_ = stage, training_ = training; }
  void set_current_batch_size(int64_t n) { batch_size_ = n; }
  void set_metric_sync(std::function<void(metrics::MetricCollection&)> sync) { metric_sync_ = std::move(sync); }

  LogSink* sink_ = nullptr;
  Stage stage_ = Stage::Fit;
  bool training_ = false;
  int64_t batch_size_ = 1;
  std::function<void(metrics::MetricCollection&)> metric_sync_;
};

// A task wraps a model: classification, detection, language_modeling.
using TaskRegistry = Registry<std::shared_ptr<Module>, std::shared_ptr<Model>>;
TaskRegistry& task_registry();

}  // namespace strobe
