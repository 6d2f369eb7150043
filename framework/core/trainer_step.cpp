// Trainer, the step: one training batch (forward, backward) and, at the end of an accumulation
// window, the optimizer step through StepPipeline, in Lightning's hook order:
//   on_train_batch_start -> forward -> on_before_backward -> backward -> on_after_backward
//   [last micro-batch] on_before_optimizer_step -> (check, clip, optimizer: StepPipeline::step)
//   -> on_before_zero_grad -> zero_grad -> scheduler
// Under trainer.cuda_graphs the batch goes to run_graphed_batch (trainer_graph.cpp) instead.
#include <fmt/format.h>
#include <torch/torch.h>

#include "framework/core/precision.h"
#include "framework/core/trainer.h"
#include "framework/distributed/strategy.h"
#include "framework/logging/log_collector.h"

namespace strobe {

StepPipeline& Trainer::step_pipeline() {
  if (!pipeline_) throw std::logic_error("Trainer::step_pipeline() before setup_for_fit()");
  return *pipeline_;
}

void Trainer::arm_step_guard(const StepGuard& guard) {
  pending_guard_ |= guard;
  if (pipeline_) pipeline_->arm(pending_guard_);
}

void Trainer::optimizer_step() {
  // Data parallel: the gradients are the mean over ranks from here on (the all-reduces ran inside
  // the last backward); callbacks, the non-finite check and clipping see the reduced ones.
  strategy_->finish_grad_sync();
  each([&](Callback& cb) { cb.on_before_optimizer_step(*this, *module_, *optimizer_); });
  pipeline_->step();
  finish_optimizer_step(/*zero_grads=*/true);
}

void Trainer::finish_optimizer_step(bool zero_grads) {
  each([&](Callback& cb) { cb.on_before_zero_grad(*this, *module_, *optimizer_); });
  if (zero_grads) {
    optimizer_->zero_grad(true);
    if (masters_) {  // the optimizer holds the masters: the bf16 parameters' gradients are cleared here
      masters_->release_grads();
      module_->net().zero_grad(true);
    }
  }
  accum_count_ = 0;
  ++state_.global_step;
  if (scheduler_) scheduler_->step(state_.global_step);
  bool emit = state_.global_step % exp_.trainer.log_every_n_steps == 0 || state_.global_step == 1;
  collector_->end_step(state_.global_step, state_.epoch, emit);
  share_stop_code(/*blocking=*/false);
}

torch::Tensor Trainer::run_training_batch(Batch host_batch, int64_t batch_idx) {
  setup_for_fit();
  module_->attach(collector_.get(), Stage::Fit, true);
  collector_->set_training(true);
  each([&](Callback& cb) { cb.on_train_batch_start(*this, *module_, host_batch, batch_idx); });
  if (graph_) return run_graphed_batch(prepare_batch(std::move(host_batch), 0), batch_idx);
  return run_eager_batch(prepare_batch(std::move(host_batch), 0), batch_idx);
}

torch::Tensor Trainer::run_eager_batch(Batch batch, int64_t batch_idx) {
  if (accum_count_ == 0) pipeline_->begin_step();
  const bool last_of_epoch = batch_idx + 1 >= num_train_batches_;
  const bool steps_now = accum_count_ + 1 >= exp_.trainer.accumulate_grad_batches || last_of_epoch;
  // Accumulation micro-batches all-reduce nothing; the step's last one carries the sum.
  strategy_->set_grad_sync(steps_now);
  module_->set_current_batch_size(batch.batch_size());
  torch::Tensor loss;
  {
    AutocastGuard ac(device_, exp_.trainer.precision);
    loss = module_->training_step(batch, batch_idx);
  }
  if (loss.defined()) {
    auto to_backward = pipeline_->prepare_backward(loss);
    each([&](Callback& cb) { cb.on_before_backward(*this, *module_, loss); });
    strategy_->pre_backward();
    to_backward.backward();
    each([&](Callback& cb) { cb.on_after_backward(*this, *module_); });
  }
  ++accum_count_;
  if (steps_now) optimizer_step();
  return loss.defined() ? loss.detach() : loss;
}

}  // namespace strobe
