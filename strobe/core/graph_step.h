// GraphedRunner: trainer.cuda_graphs, a TrainingRunner (step_runner.h) that FitLoop calls like the
// eager one; GraphedStep: its captured state (graph_step.cpp).
//
// The whole optimizer step — forward, loss, backward, the step pipeline's checks, clipping, loss
// scaling and the fused optimizer (with the master-weight copy under bf16-master) — is captured once
// into a CUDA graph and replayed for every later batch of the same signature (the shapes, strides
// and dtypes of the batch's tensors, its host facts, and the armed step guard):
//   - the first kWarmupSteps steps run eagerly (optimizer state, cuDNN/cuBLAS plans, lazily created
//     tensors all exist before capture);
//   - the batch is copied into static input tensors, the optimizers read the learning rate from a
//     device tensor (so schedules keep working), gradients stay allocated between steps (the graph
//     overwrites them), values the module logs are recorded at capture and handed to the logger
//     after each replay, and the step record (non-finite verdict, gradient norms, losses, buffer
//     snapshot) is copied out for NaN capture: device flags only, no host read;
//   - a batch of another signature (the smaller last batch of an epoch, a varlen batch) runs
//     eagerly; a change of the step guard (NaN capture arming its sticky flag) captures anew.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "strobe/core/module.h"
#include "strobe/core/step_pipeline.h"
#include "strobe/core/step_runner.h"
#include "strobe/data/batch.h"

namespace strobe {

namespace ops {
class CudaGraph;
class FusedOptimizerBase;
}

// What a module logs while its step is being captured: replayed into the real sink after each replay.
class RecordingSink : public LogSink {
 public:
  struct Entry {
    std::string name;
    torch::Tensor value;
    LogOptions options;
    int64_t batch_size = 0;
  };
  void log(const std::string& name, const torch::Tensor& value, const LogOptions& options, int64_t batch_size) override {
    entries.push_back({name, value.detach(), options, batch_size});
  }
  std::vector<Entry> entries;
};

struct GraphedStep {
  static constexpr int64_t kWarmupSteps = 3;

  GraphedStep();
  ~GraphedStep();

  // "name:dtype:device:sizes:strides;..." + the host facts (meta) except the loader's position
  // (batch_index, epoch); and the armed guard: a replay needs both keys equal to the capture's.
  static std::string batch_signature(const Batch& batch);
  static std::string guard_signature(const StepGuard& guard);
  void reset();  // drops the graph and everything captured with it

  std::unique_ptr<ops::CudaGraph> graph;
  std::string batch_key, guard_key;
  Batch static_batch;
  std::vector<RecordingSink::Entry> logged;
  StepRecord record;  // the captured step's record (its tensors are the graph's outputs)
  int64_t eager_steps = 0;  // steps run eagerly in this process (warm-up counts them)
  int64_t captures = 0, replays = 0;
};

// Replays the captured step for every batch of the captured signature; captures after the warm-up
// (and anew when the batch's signature or the armed step guard changes); runs other batches through
// `eager`. `optimizer`: Strobe's fused optimizer (its lr read from the device: schedules keep
// working; the Trainer builds this runner only with one); `collector`: where the module's logged values go (recorded at capture, handed over after
// each replay).
class GraphedRunner : public TrainingRunner {
 public:
  GraphedRunner(EagerRunner& eager, StepRunner& step, Module& module, StepPipeline& pipeline,
                ops::FusedOptimizerBase& optimizer, LogSink& collector, torch::Device device);
  ~GraphedRunner() override;
  torch::Tensor run(Batch batch, const MicroBatch& mb) override;
  void zero_grad() override;
  // Drops the captured graph and its gradients and starts the warm-up anew (the set of parameters
  // that take gradients changed: optimizer.param_groups.freeze).
  void invalidate();
  int64_t captures() const { return g_.captures; }
  int64_t replays() const { return g_.replays; }

 private:
  EagerRunner& eager_;
  StepRunner& step_;
  Module& module_;
  StepPipeline& pipeline_;
  ops::FusedOptimizerBase& optimizer_;
  LogSink& collector_;
  torch::Device device_;
  GraphedStep g_;
  bool last_eager_ = false;  // the last step ran eagerly: its gradients are released as the eager loop's
  // The optimizer's gradients (the fp32 masters' under bf16-master) and the model's, released.
  void release_grads();
};

}  // namespace strobe
