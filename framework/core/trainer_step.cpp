// Trainer, the step: one training batch (forward, backward) and, at the end of an accumulation
// window, the optimizer step through StepPipeline, in Lightning's hook order:
//   on_train_batch_start -> forward -> on_before_backward -> backward -> on_after_backward
//   [last micro-batch] on_before_optimizer_step -> (check, clip, optimizer: StepPipeline::step)
//   -> on_before_zero_grad -> zero_grad -> scheduler
// The forward-to-update part is StepRunner's (step_runner.h), which CUDA-graph capture runs too;
// under trainer.cuda_graphs the batch goes to run_graphed_batch (trainer_graph.cpp).
#include <utility>

#include <fmt/format.h>
#include <torch/torch.h>

#include "framework/core/trainer.h"
#include "framework/distributed/strategy.h"
#include "framework/logging/log_collector.h"

namespace strobe {

StepPipeline& Trainer::step_pipeline() { return const_cast<StepPipeline&>(std::as_const(*this).step_pipeline()); }

const StepPipeline& Trainer::step_pipeline() const {
  if (!pipeline_) throw std::logic_error("Trainer::step_pipeline() before setup_for_fit()");
  return *pipeline_;
}

void Trainer::arm_step_guard(const StepGuard& guard) {
  pending_guard_ |= guard;
  if (pipeline_) pipeline_->arm(pending_guard_);
}

// The eager step's hooks: the callbacks' in-step hooks and the data-parallel strategy's calls.
class Trainer::EagerStepHooks : public StepRunner::Hooks {
 public:
  explicit EagerStepHooks(Trainer& t) : t_(t) {}
  // Accumulation micro-batches all-reduce nothing; the step's last one carries the sum.
  void before_forward(bool last_micro_batch) override { t_.strategy_->set_grad_sync(last_micro_batch); }
  void before_backward(const torch::Tensor& loss) override {
    t_.each([&](Callback& cb) {
      if (InStepHooks* h = cb.in_step_hooks()) h->on_before_backward(t_, *t_.module_, loss);
    });
    t_.strategy_->pre_backward();
  }
  void after_backward() override {
    t_.each([&](Callback& cb) {
      if (InStepHooks* h = cb.in_step_hooks()) h->on_after_backward(t_, *t_.module_);
    });
  }
  void before_optimizer_step() override {
    // Data parallel: the gradients are the mean over ranks from here on (the all-reduces ran inside
    // the last backward); callbacks, the non-finite check and clipping see the reduced ones.
    t_.strategy_->finish_grad_sync();
    t_.each([&](Callback& cb) {
      if (InStepHooks* h = cb.in_step_hooks()) h->on_before_optimizer_step(t_, *t_.module_, *t_.optimizer_);
    });
  }

 private:
  Trainer& t_;
};

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
  auto& loop = fit_loop_->state();
  ++loop.global_step;
  if (scheduler_) scheduler_->step(loop.global_step);
  bool emit = loop.global_step % exp_.trainer.log_every_n_steps == 0 || loop.global_step == 1;
  collector_->end_step(loop.global_step, loop.epoch, emit);
  fit_loop_->share_stop_code(/*blocking=*/false);
}

Batch Trainer::prepare_batch(Batch batch, int64_t idx) {
  if (datamodule_->injected_batch() && module_->stage() == Stage::Fit && module_->training()) batch = *datamodule_->injected_batch();
  batch = datamodule_->on_before_batch_transfer(std::move(batch), idx);
  batch = transfer_(device_, [&] { return datamodule_->transfer_batch_to_device(batch, device_, idx); });
  return datamodule_->on_after_batch_transfer(std::move(batch), idx);
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
  EagerStepHooks hooks(*this);
  StepRunner::Options options;
  options.first_micro_batch = accum_count_ == 0;
  options.last_micro_batch =
      accum_count_ + 1 >= exp_.trainer.accumulate_grad_batches || batch_idx + 1 >= fit_loop_->num_batches();
  options.hooks = &hooks;
  auto loss = step_runner_->run(batch, batch_idx, options);
  ++accum_count_;
  if (options.last_micro_batch) finish_optimizer_step(/*zero_grads=*/true);
  return loss;
}

}  // namespace strobe
