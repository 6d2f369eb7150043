// StepRunner: one training micro-batch, written once. The eager runner and the CUDA-graph capture
// (graph_step.h) both run it; what differs between them is stated by StepRunner::Options, not by a
// second copy of the step.
//
//   [first micro-batch]  pipeline.begin_step()
//   hooks.before_forward(last)          data parallel: whether this micro-batch all-reduces
//   forward: module.training_step() under the precision's autocast
//   [loss defined]  to_backward = pipeline.prepare_backward(loss)
//                   hooks.before_backward(loss); to_backward.backward(); hooks.after_backward()
//   [last micro-batch]  hooks.before_optimizer_step(); pipeline.step()
//
// After the update, FitLoop finishes the optimizer step (callbacks' on_before_zero_grad, the
// runner's zero_grad, counters, scheduler, logging: fit_loop.cpp), whichever runner ran it.
//
// TrainingRunner: what FitLoop calls for one micro-batch. EagerRunner runs StepRunner with the
// callbacks' in-step hooks and the strategy's calls (CallbackStepHooks); GraphedRunner (graph_step.h)
// replays a captured step and falls back to its EagerRunner. Neither knows the Trainer.
//
// Contract:
// - The captured step passes no hooks (Options::hooks == nullptr): a replayed graph runs none of
//   the code around its kernels, so callbacks with in-step hooks and data-parallel runs are refused
//   when trainer.cuda_graphs is set up, and the step runs exactly the same device work as the eager
//   one (graphed = eager bitwise, tests/gpu_trainer).
// - run() makes no host read of its own; the step pipeline's (step_pipeline.h) are the only ones.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "strobe/core/loop_state.h"
#include "strobe/core/module.h"
#include "strobe/core/step_pipeline.h"
#include "strobe/data/batch.h"

namespace torch::optim {
class Optimizer;
}

namespace strobe {

class Callback;
class MasterWeights;
class TrainerView;
namespace distributed {
class Strategy;
}

class StepRunner {
 public:
  // What runs around the step's device work in the eager loop: the callbacks' in-step hooks and
  // the data-parallel strategy's calls. Every hook defaults to nothing.
  class Hooks {
   public:
    virtual ~Hooks() = default;
    // Before the forward; `last_micro_batch`: this micro-batch ends the optimizer step.
    virtual void before_forward(bool last_micro_batch) { (void)last_micro_batch; }
    // Between prepare_backward and backward (the loss as training_step returned it).
    virtual void before_backward(const torch::Tensor& loss) { (void)loss; }
    virtual void after_backward() {}
    // Last micro-batch only: before the pipeline's check, clipping and update (gradients editable).
    virtual void before_optimizer_step() {}
  };

  struct Options {
    bool first_micro_batch = true;  // begins the optimizer step: the pipeline's begin_step()
    bool last_micro_batch = true;   // ends it: the pipeline's step() (check, clip, update)
    Hooks* hooks = nullptr;         // null: none (the captured step)
    bool require_loss = false;      // a training_step without a loss is an error (the captured step)
  };

  StepRunner(Module& module, StepPipeline& pipeline, torch::Device device, Precision precision);

  // Runs the micro-batch `batch` (on the device). Returns the loss, detached (undefined when
  // training_step returned none: nothing is backpropagated, the step still ends when `last`).
  torch::Tensor run(const Batch& batch, int64_t batch_idx, const Options& options);

 private:
  Module& module_;
  StepPipeline& pipeline_;
  torch::Device device_;
  Precision precision_;
};

// Where a micro-batch sits: its index in the epoch, whether it begins or ends the optimizer step,
// and whether it is the epoch's last batch (where a smaller batch comes).
struct MicroBatch {
  int64_t index = 0;
  bool first = true;
  bool last = true;
  bool epoch_last = false;
};

// One training micro-batch for FitLoop (the batch already on the device).
class TrainingRunner {
 public:
  virtual ~TrainingRunner() = default;
  // The forward, the backward and, when `mb.last`, the optimizer update. Returns the loss, detached.
  virtual torch::Tensor run(Batch batch, const MicroBatch& mb) = 0;
  // After an update and the callbacks' on_before_zero_grad: the gradients released for the next
  // step (unless the step was a graph replay, whose graph overwrites them).
  virtual void zero_grad() = 0;
};

// The eager step's hooks: the callbacks' in-step hooks (InStepHooks) and the data-parallel strategy.
// `view` is handed to the callbacks' hooks, never used here; `state`: the fit loop's counters (the
// step a fault point names).
class CallbackStepHooks : public StepRunner::Hooks {
 public:
  CallbackStepHooks(TrainerView& view, Module& module, const std::vector<std::shared_ptr<Callback>>& callbacks,
                    distributed::Strategy& strategy, torch::optim::Optimizer& optimizer, const TrainerState& state);
  void before_forward(bool last_micro_batch) override;
  void before_backward(const torch::Tensor& loss) override;
  void after_backward() override;
  void before_optimizer_step() override;

 private:
  TrainerView& view_;
  Module& module_;
  const std::vector<std::shared_ptr<Callback>>& callbacks_;
  distributed::Strategy& strategy_;
  torch::optim::Optimizer& optimizer_;
  const TrainerState& state_;
};

class EagerRunner : public TrainingRunner {
 public:
  // `masters`: bf16-master's fp32 masters (null: none), whose gradients zero_grad releases too.
  EagerRunner(StepRunner& step, StepRunner::Hooks& hooks, Module& module, torch::optim::Optimizer& optimizer,
              MasterWeights* masters);
  torch::Tensor run(Batch batch, const MicroBatch& mb) override;
  void zero_grad() override;

 private:
  StepRunner& step_;
  StepRunner::Hooks& hooks_;
  Module& module_;
  torch::optim::Optimizer& optimizer_;
  MasterWeights* masters_;
};

}  // namespace strobe
