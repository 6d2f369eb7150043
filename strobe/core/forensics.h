// Forensics: which operation, inside which module, first produced a non-finite value.
//
// libtorch modules have no forward hooks, so attribution is built from two pieces:
// - NonFiniteTracer installs an at::RecordFunction observer over every dispatched op (forward ops
//   and the autograd engine's backward functions). After each op it checks the floating outputs;
//   the first op whose output holds NaN/Inf is reported with statistics of its inputs and output.
//   The module is found by identity: an op that takes a parameter belongs to that parameter's
//   module (`layer3.1.conv2`); other ops belong to the innermost ModuleScope (`task.loss`, or a
//   model block that declares one), else they are reported as following the last module seen.
//   Backward ops inherit the module of the forward op they differentiate: every autograd node a
//   top-level op creates (its own, or those of the ops a composite or a custom autograd Function such
//   as a fused op runs inside it) is linked to it by the node's sequence number and the thread that
//   created it (each thread numbers its own nodes). An activation checkpoint's recompute
//   (RecomputeScope) runs forward ops inside a backward: they are linked the same way.
// - ModuleScope is an RAII marker that code (tasks, model blocks) places around a region. It costs
//   one thread-local read when no tracer is installed: the tracer exists only while replaying.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <torch/types.h>

namespace torch::nn {
class Module;
}

namespace strobe {

class ModuleScope {
 public:
  explicit ModuleScope(const char* path);
  ~ModuleScope();
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;

 private:
  bool active_;
};

// Marks an activation checkpoint's recompute (strobe/core/activation_checkpoint.h): the block's
// forward run again inside the backward. While one is open, the ops it runs are forward ops of the
// block (attributed to their modules, their autograd nodes linked to them), not backward ops of the
// checkpoint's node. One thread-local read when no tracer is installed.
class RecomputeScope {
 public:
  RecomputeScope();
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  bool active_;
};

struct TensorStats {
  std::string name;  // "input 0", "output", or a parameter name
  std::vector<int64_t> shape;
  std::string dtype;
  int64_t numel = 0, nan = 0, pos_inf = 0, neg_inf = 0;
  double min = 0, max = 0, mean_abs = 0;  // over the finite elements
  nlohmann::json to_json() const;
};
TensorStats tensor_stats(const torch::Tensor& t, std::string name);

struct NonFiniteEvent {
  std::string op;        // outermost op whose output was non-finite, e.g. aten::div
  std::string kernel;    // the innermost op that first produced it (may equal op)
  std::string module;    // e.g. layer3.1.conv2, task.loss
  std::string phase;     // forward | backward
  std::string note;      // how the module was attributed, or why inputs were already non-finite
  bool inputs_finite = true;
  std::vector<TensorStats> inputs;
  TensorStats output;
  // The output's leading dimension and which of its indices hold a non-finite value (the rows of a
  // batch when that dimension is the batch's; replay --diagnose maps them to samples). Empty for a
  // 0-d output.
  int64_t output_rows = 0;
  std::vector<int64_t> nonfinite_rows;
  nlohmann::json to_json() const;
};

class NonFiniteTracer {
 public:
  // `net` provides the parameter -> module-path map (paths as net.named_modules() spells them).
  explicit NonFiniteTracer(torch::nn::Module& net);
  ~NonFiniteTracer();  // removes the observer
  NonFiniteTracer(const NonFiniteTracer&) = delete;
  NonFiniteTracer& operator=(const NonFiniteTracer&) = delete;

  std::optional<NonFiniteEvent> first() const;
  // Ops observed so far (a replay that observed none did not trace anything: a bug, not a verdict).
  int64_t ops_observed() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace strobe
