// Trainer, the step's parts: the step pipeline, StepRunner and the runner FitLoop calls for each
// training micro-batch (step_runner.h: the eager one with the callbacks' in-step hooks and the
// strategy; under trainer.cuda_graphs the graphed one, graph_step.h), and the batch preparation the
// loops share. One step's path runs downward from FitLoop (fit_loop.cpp); the Trainer only builds it.
#include <utility>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/graph_step.h"
#include "strobe/core/trainer.h"
#include "strobe/distributed/strategy.h"
#include "strobe/logging/log_collector.h"

#if STROBE_HAS_OPS
#include "strobe/ops/cuda_graph.h"
#include "strobe/ops/fused_optimizers.h"
#endif

namespace strobe {

const StepPipelineView& Trainer::step_pipeline() const {
  if (!pipeline_) throw std::logic_error("StepAccess::step_pipeline() before fit's setup");
  return *pipeline_;
}

void Trainer::arm_step_guard(const StepGuard& guard) {
  pending_guard_ |= guard;
  if (pipeline_) pipeline_->arm(pending_guard_);
}

Trainer::GraphCounts Trainer::graph_counts() const {
  if (!graphed_runner_) return {};
  return {graphed_runner_->captures(), graphed_runner_->replays()};
}

void Trainer::setup_runners() {
  step_runner_ = std::make_unique<StepRunner>(*module_, *pipeline_, device_, exp_.trainer.precision);
  step_hooks_ = std::make_unique<CallbackStepHooks>(view(), *module_, callbacks_, *strategy_, *optimizer_, fit_loop_->state());
  eager_runner_ = std::make_unique<EagerRunner>(*step_runner_, *step_hooks_, *module_, *optimizer_,
                                                 zero2_ ? nullptr : masters_.get());
  if (exp_.trainer.cuda_graphs != "false") setup_cuda_graphs();
  fit_loop_->set_runner(graphed_runner_ ? static_cast<TrainingRunner*>(graphed_runner_.get()) : eager_runner_.get());
  fit_loop_->set_optimizer(optimizer_.get(), scheduler_.get());
}

void Trainer::setup_cuda_graphs() {
#if STROBE_HAS_OPS
  auto* fused = dynamic_cast<ops::FusedOptimizerBase*>(optimizer_.get());
#endif
  // Why this run cannot be captured ("" when it can): `true` makes it a config error, `auto` keeps
  // the run eager.
  auto why_not = [&]() -> std::string {
    if (!device_.is_cuda()) return fmt::format("needs a CUDA device (this run's device is {})", device_.str());
#if STROBE_HAS_OPS
    if (!ops::cuda_graphs_supported()) return "this build's operator library has no CUDA support";
    if (fused == nullptr)
      return "needs Strobe's fused optimizer step (optimizer.fused: auto or true with dense fp32 parameters); "
             "torch::optim's step reads the skip flag on the host";
    if (world_size_ > 1) return "data-parallel runs (more than one process) are not captured";
    if (exp_.trainer.accumulate_grad_batches != 1)
      return fmt::format("needs accumulate_grad_batches: 1 (got {}): a captured step is one micro-batch",
                         exp_.trainer.accumulate_grad_batches);
    for (const auto& cb : callbacks_)
      if (cb->in_step_hooks() != nullptr)
        return fmt::format("callback '{}' runs hooks inside the step (on_before_backward, on_after_backward or "
                           "on_before_optimizer_step), which a replayed graph would skip",
                           cb->name());
    return "";
#else
    return "this build has no custom operators (no fused optimizer, no graph capture)";
#endif
  }();
  if (!why_not.empty()) {
    if (exp_.trainer.cuda_graphs == "true") throw config::ConfigError("trainer.cuda_graphs: " + why_not);
    return;  // auto: eager steps
  }
#if STROBE_HAS_OPS
  graphed_runner_ = std::make_unique<GraphedRunner>(*eager_runner_, *step_runner_, *module_, *pipeline_, *fused,
                                                    *collector_, device_);
#endif
}

}  // namespace strobe
