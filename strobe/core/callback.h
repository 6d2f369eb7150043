// Callback: Lightning's hook set. Every hook is a no-op virtual, so a callback overrides only what it
// uses. Callbacks see the trainer through TrainerView (trainer_view.h: counters, metrics, stop
// requests, checkpointing, each with its contract) and never the Trainer itself.
// state_dict()/load_state_dict() are saved in every checkpoint under state_key(), which must be
// unique among a run's callbacks.
#pragma once

#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include <nlohmann/json_fwd.hpp>
#include <torch/types.h>

#include "strobe/config/registry.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/batch.h"

namespace torch::optim {
class Optimizer;
}

namespace strobe {

class TrainerView;
class Module;
namespace checkpoint {
struct CheckpointData;
}

// The hooks that run between the forward and the optimizer, inside what trainer.cuda_graphs captures
// once and replays (docs/ARCHITECTURE.md, "CUDA graphs"). A callback with any of them implements this
// interface as well and returns itself from Callback::in_step_hooks(); such a callback makes
// cuda_graphs refuse the run (true) or train eagerly (auto).
class InStepHooks {
 public:
  virtual ~InStepHooks() = default;
  virtual void on_before_backward(TrainerView&, Module&, const torch::Tensor& /*loss*/) {}
  virtual void on_after_backward(TrainerView&, Module&) {}
  virtual void on_before_optimizer_step(TrainerView&, Module&, torch::optim::Optimizer&) {}
};

class Callback {
 public:
  virtual ~Callback() = default;
  virtual std::string name() const = 0;
  virtual std::string state_key() const { return name(); }
  // A directory this callback writes checkpoints to ("" for none or the run directory's own): `strobe
  // fit` claims one outside the run directory as it claims the run directory (docs/CONFIG.md, "Run
  // directory"): never another run's, locked while this run lives.
  virtual std::string checkpoint_dir() const { return ""; }
  // A checkpointing callback's best checkpoint so far, for the run summary: its path (a file inside
  // `run_dir` joined to it), the monitored metric and its score ("" and 0 without a monitor: the
  // latest). nullopt for other callbacks, or before one was written.
  struct SavedCheckpoint {
    std::string path, monitor;
    double score = 0;
  };
  virtual std::optional<SavedCheckpoint> best_checkpoint(const std::string& /*run_dir*/) const { return std::nullopt; }

  virtual void setup(TrainerView&, Module&, Stage) {}
  virtual void teardown(TrainerView&, Module&, Stage) {}
  virtual void on_fit_start(TrainerView&, Module&) {}
  virtual void on_fit_end(TrainerView&, Module&) {}
  virtual void on_sanity_check_start(TrainerView&, Module&) {}
  virtual void on_sanity_check_end(TrainerView&, Module&) {}
  virtual void on_train_start(TrainerView&, Module&) {}
  virtual void on_train_end(TrainerView&, Module&) {}
  virtual void on_train_epoch_start(TrainerView&, Module&) {}
  virtual void on_train_epoch_end(TrainerView&, Module&) {}
  virtual void on_train_batch_start(TrainerView&, Module&, const Batch&, int64_t /*batch_idx*/) {}
  virtual void on_train_batch_end(TrainerView&, Module&, const torch::Tensor& /*loss*/, const Batch&, int64_t /*batch_idx*/) {}
  // After everything a training batch logs: every on_train_batch_end, the validation it triggers
  // and, on an epoch's last batch, the epoch's end (on_train_epoch_end). Checkpoints are written
  // here, so a checkpoint always holds its step's whole log (docs/ARCHITECTURE.md, "The end of a step").
  virtual void on_train_batch_complete(TrainerView&, Module&) {}
  virtual void on_validation_start(TrainerView&, Module&) {}
  virtual void on_validation_end(TrainerView&, Module&) {}
  virtual void on_validation_epoch_start(TrainerView&, Module&) {}
  virtual void on_validation_epoch_end(TrainerView&, Module&) {}
  virtual void on_validation_batch_start(TrainerView&, Module&, const Batch&, int64_t) {}
  virtual void on_validation_batch_end(TrainerView&, Module&, const Batch&, int64_t) {}
  virtual void on_test_start(TrainerView&, Module&) {}
  virtual void on_test_end(TrainerView&, Module&) {}
  virtual void on_test_epoch_start(TrainerView&, Module&) {}
  virtual void on_test_epoch_end(TrainerView&, Module&) {}
  virtual void on_test_batch_start(TrainerView&, Module&, const Batch&, int64_t) {}
  virtual void on_test_batch_end(TrainerView&, Module&, const Batch&, int64_t) {}
  virtual void on_predict_start(TrainerView&, Module&) {}
  virtual void on_predict_end(TrainerView&, Module&) {}
  virtual void on_predict_epoch_start(TrainerView&, Module&) {}
  virtual void on_predict_epoch_end(TrainerView&, Module&) {}
  virtual void on_predict_batch_start(TrainerView&, Module&, const Batch&, int64_t) {}
  virtual void on_predict_batch_end(TrainerView&, Module&, const torch::Tensor& /*outputs*/, const Batch&, int64_t) {}
  // The hooks that run inside the step (InStepHooks, below), or null (the default): a callback that
  // has them returns its InStepHooks here. The trainer calls them only through this, so a callback
  // cannot have in-step hooks without saying so, and trainer.cuda_graphs refuses a run whose
  // callbacks return one (a replayed graph would skip them). on_train_batch_start/end and
  // on_before_zero_grad run outside the graph, every step.
  virtual InStepHooks* in_step_hooks() { return nullptr; }
  virtual void on_before_zero_grad(TrainerView&, Module&, torch::optim::Optimizer&) {}
  virtual void on_exception(TrainerView&, Module&, const std::exception&) {}
  virtual void on_save_checkpoint(TrainerView&, Module&, checkpoint::CheckpointData&) {}
  virtual void on_load_checkpoint(TrainerView&, Module&, const checkpoint::CheckpointData&) {}

  virtual nlohmann::json state_dict() const;
  virtual void load_state_dict(const nlohmann::json& state);
};

// A callback's hook that threw something that is not a std::exception (a plugin's `throw 42;`): the
// boundary turns it into this error naming the callback and the hook, so it ends the run as any error
// does (one line, exit 1, on_exception_checkpoint written) instead of terminating the process.
struct CallbackError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs `f`, one hook of `cb`, at that boundary.
template <class F>
void call_hook(const Callback& cb, const char* hook, F&& f) {
  try {
    f();
  } catch (const std::exception&) {
    throw;
  } catch (...) {
    throw CallbackError(fmt::format("callback '{}': {} threw an exception that is not a std::exception", cb.name(), hook));
  }
}

using CallbackRegistry = Registry<std::shared_ptr<Callback>>;
CallbackRegistry& callback_registry();

}  // namespace strobe
