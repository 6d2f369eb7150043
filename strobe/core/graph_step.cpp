// GraphedRunner, trainer.cuda_graphs: the whole optimizer step captured once and replayed (graph_step.h).
#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "strobe/core/engine_access.h"
#include "strobe/core/graph_step.h"
#include "strobe/logging/log_collector.h"

#if STROBE_HAS_OPS
#include "strobe/ops/cuda_graph.h"
#include "strobe/ops/fused_optimizers.h"
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
  // Host facts shape the launches (max_seqlen, batch_size); the loader's position and a mix's source
  // counts do not.
  for (const auto& [name, v] : batch.meta)
    if (name != kMetaBatchIndex && name != kMetaEpoch && name.rfind(kMetaSourcePrefix, 0) != 0)
      key += fmt::format("{}={};", name, v);
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

GraphedRunner::GraphedRunner(EagerRunner& eager, StepRunner& step, Module& module, StepPipeline& pipeline,
                             ops::FusedOptimizerBase& optimizer, LogSink& collector, torch::Device device)
    : eager_(eager), step_(step), module_(module), pipeline_(pipeline), optimizer_(optimizer), collector_(collector),
      device_(device) {
#if STROBE_HAS_OPS
  optimizer_.enable_device_lr();
  g_.graph = std::make_unique<ops::CudaGraph>();
#else
  throw std::logic_error("GraphedRunner without operator library");
#endif
}

GraphedRunner::~GraphedRunner() = default;

void GraphedRunner::release_grads() {
  optimizer_.zero_grad(true);
  module_.net().zero_grad(true);
}

void GraphedRunner::invalidate() {
  // The gradients a replay left allocated live in the graph's pool: released before the graph.
  release_grads();
  g_.reset();
  g_.eager_steps = 0;
  last_eager_ = true;
}

void GraphedRunner::zero_grad() {
  if (last_eager_) eager_.zero_grad();
}

torch::Tensor GraphedRunner::run(Batch batch, const MicroBatch& mb) {
#if STROBE_HAS_OPS
  auto& g = g_;
  const int64_t batch_idx = mb.index;
  optimizer_.sync_device_lr();  // the scheduler's lr for this step, eager or replayed
  EngineAccess::set_current_batch_size(module_, batch.batch_size());
  const std::string batch_key = GraphedStep::batch_signature(batch);
  const std::string guard_key = GraphedStep::guard_signature(pipeline_.guard());
  const bool warm = g.eager_steps >= GraphedStep::kWarmupSteps;
  const bool same_batch = g.graph->captured() && batch_key == g.batch_key;
  // An epoch's last batch is where a smaller batch comes: never the first one captured.
  const bool last_of_epoch = mb.epoch_last;
  if (!warm || (g.graph->captured() ? !same_batch : last_of_epoch)) {
    // Eagerly: the gradients a replay left allocated must not be accumulated into.
    release_grads();
    ++g.eager_steps;
    last_eager_ = true;
    return eager_.run(std::move(batch), mb);
  }
  last_eager_ = false;
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
          EngineAccess::attach(module, sink, Stage::Fit, true);
          at::autocast::set_autocast_cache_enabled(false);
        }
        ~CaptureScope() {
          at::autocast::set_autocast_cache_enabled(cache);
          EngineAccess::attach(module, collector, Stage::Fit, true);
        }
      } scope(module_, &collector_, &sink);
      // The eager step without its hooks (step_runner.h): one micro-batch, begun and ended here.
      StepRunner::Options options;
      options.require_loss = true;
      g.graph->capture(device_, [&] { step_.run(g.static_batch, batch_idx, options); });
    } catch (const std::exception& e) {
      g.reset();
      throw std::runtime_error(fmt::format(
          "trainer.cuda_graphs: capturing the training step failed: {} (the step must not read device values on "
          "the host or copy from pageable host memory; set trainer.cuda_graphs: false to train without graphs)",
          e.what()));
    }
    g.logged = std::move(sink.entries);
    g.record = pipeline_.last();
    g.batch_key = batch_key, g.guard_key = guard_key;
    ++g.captures;
  } else {
    for (auto& [name, t] : g.static_batch.tensors) t.copy_(batch.tensors.at(name), /*non_blocking=*/true);
  }
  // The capture recorded the step without running it: every graphed step is a replay.
  g.graph->replay();
  ++g.replays;
  // Outputs the next replay overwrites are copied for whoever keeps them (logger, NaN capture).
  for (const auto& e : g.logged) collector_.log(e.name, e.value.clone(), e.options, e.batch_size);
  pipeline_.step_replayed(g.record);
  const auto& losses = pipeline_.last().losses;
  return losses.empty() ? torch::Tensor() : losses.front();
#else
  (void)batch, (void)mb;
  throw std::logic_error("GraphedRunner without operator library");
#endif
}

}  // namespace strobe
