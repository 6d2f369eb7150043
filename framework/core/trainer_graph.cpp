// Trainer, trainer.cuda_graphs: the whole optimizer step captured once and replayed (graph_step.h).
#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "framework/core/graph_step.h"
#include "framework/core/trainer.h"
#include "framework/logging/log_collector.h"

#if STROBE_HAS_OPS
#include "framework/ops/cuda_graph.h"
#include "framework/ops/fused_optimizers.h"
#endif

namespace strobe {

GraphedStep::GraphedStep() = default;
GraphedStep::~GraphedStep() = default;

std::string GraphedStep::batch_signature(const Batch& batch) {
  std::string key;
  for (const auto& [name, t] : batch.tensors) {
    key += fmt::format("{}:{}:{}:{}:{};", name, c10::toString(t.scalar_type()), t.device().str(),
                       fmt::join(t.sizes(), ","), fmt::join(t.strides(), ","));
  }
  // Host facts shape the launches (max_seqlen, batch_size); the loader's position does not.
  for (const auto& [name, v] : batch.meta)
    if (name != kMetaBatchIndex && name != kMetaEpoch) key += fmt::format("{}={};", name, v);
  return key;
}

std::string GraphedStep::guard_signature(const StepGuard& g) {
  return fmt::format("{}{}{}{}{}", int(g.check_grads), int(g.check_loss), int(g.sticky), int(g.restore_buffers),
                     int(g.snapshot_buffers));
}

void GraphedStep::reset() {
  // The graph's outputs and inputs first: their memory belongs to the graph's pool.
  static_batch = Batch{};
  logged.clear();
  record = StepRecord{};
  if (graph) graph->reset();
  batch_key.clear(), guard_key.clear();
}

int64_t Trainer::graph_captures() const { return graph_ ? graph_->captures : 0; }
int64_t Trainer::graph_replays() const { return graph_ ? graph_->replays : 0; }

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
  fused->enable_device_lr();
  graph_ = std::make_unique<GraphedStep>();
  graph_->graph = std::make_unique<ops::CudaGraph>();
#endif
}

torch::Tensor Trainer::run_graphed_batch(Batch batch, int64_t batch_idx) {
#if STROBE_HAS_OPS
  auto& g = *graph_;
  auto* fused = static_cast<ops::FusedOptimizerBase*>(optimizer_.get());
  fused->sync_device_lr();  // the scheduler's lr for this step, eager or replayed
  module_->set_current_batch_size(batch.batch_size());
  const std::string batch_key = GraphedStep::batch_signature(batch);
  const std::string guard_key = GraphedStep::guard_signature(pipeline_->guard());
  const bool warm = g.eager_steps >= GraphedStep::kWarmupSteps;
  const bool same_batch = g.graph->captured() && batch_key == g.batch_key;
  // An epoch's last batch is where a smaller batch comes: never the first one captured.
  const bool last_of_epoch = batch_idx + 1 >= fit_loop_->num_batches();
  // The optimizer's gradients (the fp32 masters' under bf16-master) and the model's, released.
  auto release_grads = [&] {
    optimizer_->zero_grad(true);
    module_->net().zero_grad(true);
  };
  if (!warm || (g.graph->captured() ? !same_batch : last_of_epoch)) {
    // Eagerly: the gradients a replay left allocated must not be accumulated into.
    release_grads();
    ++g.eager_steps;
    return run_eager_batch(std::move(batch), batch_idx);
  }
  if (!same_batch || guard_key != g.guard_key) {
    // Capture: the tensors the captured step reads are the static inputs; gradients must not exist
    // yet, so that the captured backward allocates them in the graph's pool (and overwrites them on
    // every replay instead of accumulating).
    release_grads();
    g.reset();
    g.static_batch.meta = batch.meta;
    for (const auto& [name, t] : batch.tensors) g.static_batch.tensors[name] = t.clone(at::MemoryFormat::Preserve);
    RecordingSink sink;
    try {
      // For the capture only: logging into `sink`, and autocast's weight-cast cache off (it would
      // hand the graph tensors from outside its pool); both restored however the capture ends.
      struct CaptureScope {
        Module& module;
        LogSink* collector;
        bool cache = at::autocast::is_autocast_cache_enabled();
        CaptureScope(Module& m, LogSink* c, LogSink* sink) : module(m), collector(c) {
          module.attach(sink, Stage::Fit, true);
          at::autocast::set_autocast_cache_enabled(false);
        }
        ~CaptureScope() {
          at::autocast::set_autocast_cache_enabled(cache);
          module.attach(collector, Stage::Fit, true);
        }
      } scope(*module_, collector_.get(), &sink);
      // The eager step without its hooks (step_runner.h): one micro-batch, begun and ended here.
      StepRunner::Options options;
      options.require_loss = true;
      g.graph->capture(device_, [&] { step_runner_->run(g.static_batch, batch_idx, options); });
    } catch (const std::exception& e) {
      g.reset();
      throw std::runtime_error(fmt::format(
          "trainer.cuda_graphs: capturing the training step failed: {} (the step must not read device values on "
          "the host or copy from pageable host memory; set trainer.cuda_graphs: false to train without graphs)",
          e.what()));
    }
    g.logged = std::move(sink.entries);
    g.record = pipeline_->last();
    g.batch_key = batch_key, g.guard_key = guard_key;
    ++g.captures;
  } else {
    for (auto& [name, t] : g.static_batch.tensors) t.copy_(batch.tensors.at(name), /*non_blocking=*/true);
  }
  // The capture recorded the step without running it: every graphed step is a replay.
  g.graph->replay();
  ++g.replays;
  // Outputs the next replay overwrites are copied for whoever keeps them (logger, NaN capture).
  for (const auto& e : g.logged) collector_->log(e.name, e.value.clone(), e.options, e.batch_size);
  pipeline_->set_last(clone_record(g.record));
  finish_optimizer_step(/*zero_grads=*/false);
  const auto& losses = pipeline_->last().losses;
  return losses.empty() ? torch::Tensor() : losses.front();
#else
  (void)batch, (void)batch_idx;
  throw std::logic_error("run_graphed_batch without operator library");
#endif
}

}  // namespace strobe
