// StepRunner: one training micro-batch, written once. The eager loop (trainer_step.cpp) and the
// CUDA-graph capture (trainer_graph.cpp) both run it; what differs between them is stated by
// StepRunner::Options, not by a second copy of the step.
//
//   [first micro-batch]  pipeline.begin_step()
//   hooks.before_forward(last)          data parallel: whether this micro-batch all-reduces
//   forward: module.training_step() under the precision's autocast
//   [loss defined]  to_backward = pipeline.prepare_backward(loss)
//                   hooks.before_backward(loss); to_backward.backward(); hooks.after_backward()
//   [last micro-batch]  hooks.before_optimizer_step(); pipeline.step()
//
// After run(), the caller finishes the optimizer step (callbacks' on_before_zero_grad, zero_grad,
// counters, scheduler, logging): the Trainer's finish_optimizer_step, which a replayed graph also runs.
//
// Contract:
// - The captured step passes no hooks (Options::hooks == nullptr): a replayed graph runs none of
//   the code around its kernels, so callbacks with in-step hooks and data-parallel runs are refused
//   when trainer.cuda_graphs is set up, and the step runs exactly the same device work as the eager
//   one (graphed = eager bitwise, tests/gpu_trainer).
// - run() makes no host read of its own; the step pipeline's (step_pipeline.h) are the only ones.
#pragma once

#include <cstdint>
#include <string>

#include <torch/types.h>

#include "framework/core/module.h"
#include "framework/core/step_pipeline.h"
#include "framework/data/batch.h"

namespace strobe {

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

}  // namespace strobe
