#include "strobe/core/engine_access.h"
#include "strobe/core/step_runner.h"

#include <stdexcept>

#include <torch/torch.h>

#include "strobe/core/callback.h"
#include "strobe/core/fault_points.h"
#include "strobe/core/master_weights.h"
#include "strobe/core/precision.h"
#include "strobe/distributed/strategy.h"

namespace strobe {

StepRunner::StepRunner(Module& module, StepPipeline& pipeline, torch::Device device, Precision precision)
    : module_(module), pipeline_(pipeline), device_(device), precision_(precision) {}

torch::Tensor StepRunner::run(const Batch& batch, int64_t batch_idx, const Options& options) {
  Hooks none;
  Hooks& hooks = options.hooks ? *options.hooks : none;
  if (options.first_micro_batch) pipeline_.begin_step();
  hooks.before_forward(options.last_micro_batch);
  EngineAccess::set_current_batch_size(module_, batch.batch_size());
  torch::Tensor loss;
  {
    AutocastGuard ac(device_, precision_);
    loss = module_.training_step(batch, batch_idx);
  }
  if (!loss.defined() && options.require_loss) throw std::runtime_error("training_step returned no loss");
  if (loss.defined()) {
    auto to_backward = pipeline_.prepare_backward(loss);
    hooks.before_backward(loss);
    to_backward.backward();
    hooks.after_backward();
  }
  if (options.last_micro_batch) {
    hooks.before_optimizer_step();
    pipeline_.step();
  }
  return loss.defined() ? loss.detach() : loss;
}

CallbackStepHooks::CallbackStepHooks(TrainerView& view, Module& module,
                                     const std::vector<std::shared_ptr<Callback>>& callbacks,
                                     distributed::Strategy& strategy, torch::optim::Optimizer& optimizer,
                                     const TrainerState& state)
    : view_(view), module_(module), callbacks_(callbacks), strategy_(strategy), optimizer_(optimizer), state_(state) {}

// Accumulation micro-batches all-reduce nothing; the step's last one carries the sum.
void CallbackStepHooks::before_forward(bool last_micro_batch) { strategy_.set_grad_sync(last_micro_batch); }

void CallbackStepHooks::before_backward(const torch::Tensor& loss) {
  for (auto& cb : callbacks_)
    if (InStepHooks* h = cb->in_step_hooks()) call_hook(*cb, "on_before_backward", [&] { h->on_before_backward(view_, module_, loss); });
  strategy_.pre_backward();
}

void CallbackStepHooks::after_backward() {
  for (auto& cb : callbacks_)
    if (InStepHooks* h = cb->in_step_hooks()) call_hook(*cb, "on_after_backward", [&] { h->on_after_backward(view_, module_); });
  fault_point("after_backward", state_.global_step + 1);
}

void CallbackStepHooks::before_optimizer_step() {
  // Data parallel: the gradients are the mean over ranks from here on (the all-reduces ran inside
  // the last backward); callbacks, the non-finite check and clipping see the reduced ones.
  strategy_.finish_grad_sync();
  for (auto& cb : callbacks_)
    if (InStepHooks* h = cb->in_step_hooks())
      call_hook(*cb, "on_before_optimizer_step", [&] { h->on_before_optimizer_step(view_, module_, optimizer_); });
}

EagerRunner::EagerRunner(StepRunner& step, StepRunner::Hooks& hooks, Module& module, torch::optim::Optimizer& optimizer,
                         MasterWeights* masters)
    : step_(step), hooks_(hooks), module_(module), optimizer_(optimizer), masters_(masters) {}

torch::Tensor EagerRunner::run(Batch batch, const MicroBatch& mb) {
  StepRunner::Options options;
  options.first_micro_batch = mb.first;
  options.last_micro_batch = mb.last;
  options.hooks = &hooks_;
  return step_.run(batch, mb.index, options);
}

void EagerRunner::zero_grad() {
  optimizer_.zero_grad(true);
  if (masters_) {  // the optimizer holds the masters: the bf16 parameters' gradients are cleared here
    masters_->release_grads();
    module_.net().zero_grad(true);
  }
}

}  // namespace strobe
