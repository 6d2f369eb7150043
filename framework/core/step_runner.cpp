#include "framework/core/step_runner.h"

#include <stdexcept>

#include <torch/torch.h>

#include "framework/core/precision.h"

namespace strobe {

StepRunner::StepRunner(Module& module, StepPipeline& pipeline, torch::Device device, Precision precision)
    : module_(module), pipeline_(pipeline), device_(device), precision_(precision) {}

torch::Tensor StepRunner::run(const Batch& batch, int64_t batch_idx, const Options& options) {
  Hooks none;
  Hooks& hooks = options.hooks ? *options.hooks : none;
  if (options.first_micro_batch) pipeline_.begin_step();
  hooks.before_forward(options.last_micro_batch);
  module_.set_current_batch_size(batch.batch_size());
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

}  // namespace strobe
