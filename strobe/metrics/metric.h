#pragma once
// Metric: the base of Strobe's sync-free metrics (TorchMetrics' features without its host stalls).
//
// Contract (every concrete metric):
// - State tensors live on the metric's device (`to(device)` moves them); `reset()` restores their
//   initial values in place.
// - `update(...)` takes device tensors and never synchronizes with the host: no `.item()`, no host
//   scalar turned into a device tensor, no boolean-mask indexing, no nonzero(), no shape that
//   depends on tensor values, no host branch on a value. Gradients are never recorded.
// - `compute()` returns a device tensor (a 0-dim float32 for scalar metrics) and does not
//   synchronize either; reading it on the host is the logger's job (pinned ring, async copy).
// - `state_dict()` / `load_state_dict()` carry the whole state, so a resumed run continues the
//   epoch's accumulation exactly.
// - `sync(group)` all-reduces the states across ranks (sum / min / max; gather for CatMetric). The
//   collectives are asynchronous; on NCCL the wait only orders the current stream after them. The
//   local state is kept so that `unsync()` restores it (as TorchMetrics' sync/unsync does).
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
}

namespace strobe::metrics {

// What to do with NaN inputs, decided on the device (no host check).
// - propagate: NaN flows into the state (the result becomes NaN).
// - ignore: the NaN element (value or its weight) contributes nothing.
// - replace: the NaN element is replaced by `nan_replacement` (weight 1, as in TorchMetrics).
enum class NanStrategy { kPropagate, kIgnore, kReplace };

// How per-class scores are reduced (TorchMetrics' `average`). kBinary is implied by Task::kBinary.
enum class Average { kMicro, kMacro, kWeighted, kNone };

enum class Task { kBinary, kMulticlass, kMultilabel };

struct MetricOptions {
  Task task = Task::kMulticlass;
  int64_t num_classes = 0;  // multiclass classes, multilabel labels, LM vocabulary (unused: 0)
  int64_t top_k = 1;
  // TorchMetrics' default for multiclass accuracy/precision/recall/F1 is macro; we keep it.
  Average average = Average::kMacro;
  double threshold = 0.5;               // binary / multilabel decision threshold on probabilities
  std::optional<int64_t> ignore_index;  // targets equal to it contribute nothing
  double beta = 1.0;                    // F-beta
  double zero_division = 0.0;           // value of a ratio whose denominator is 0
  NanStrategy nan_strategy = NanStrategy::kPropagate;
  double nan_replacement = 0.0;
  int64_t capacity = 0;  // CatMetric: maximum number of stored values
  torch::Device device = torch::kCPU;
};

class Metric {
 public:
  enum class Reduction { kSum, kMin, kMax, kCat };

  virtual ~Metric() = default;
  Metric(const Metric&) = delete;
  Metric& operator=(const Metric&) = delete;

  // Accumulates one batch. `first`/`second` mean, per metric: (preds, target) for classification
  // and LM metrics, (pred_boxes, target_boxes) for IoU/GIoU, (value, weight) for MeanMetric,
  // (value, -) for the other aggregators. Concrete classes name them in their own declarations.
  virtual void update(const torch::Tensor& first, const torch::Tensor& second = torch::Tensor()) = 0;
  virtual torch::Tensor compute() const = 0;

  void reset();
  std::map<std::string, torch::Tensor> state_dict() const;  // detached copies
  void load_state_dict(const std::map<std::string, torch::Tensor>& state);
  void to(const torch::Device& device);
  torch::Device device() const { return device_; }

  virtual void sync(c10d::ProcessGroup& group);
  void unsync();
  bool synced() const { return !local_state_.empty(); }

  const std::string& name() const { return name_; }

  // Metrics whose signatures are equal and non-empty accumulate identical states from identical
  // inputs (e.g. accuracy and F1 with the same task, classes, top_k, ignore_index): a
  // MetricCollection updates one of them and lets the others read its state.
  virtual std::string state_signature() const { return {}; }

 protected:
  friend class MetricCollection;
  Metric(std::string name, const torch::Device& device) : name_(std::move(name)), device_(device) {}

  // Registers a state tensor (created on the metric's device); returns its index.
  size_t add_state(std::string name, torch::Tensor initial, Reduction reduction);
  torch::Tensor& state(size_t index) { return states_[index].value; }
  const torch::Tensor& state(size_t index) const { return states_[index].value; }

  struct State {
    std::string name;
    torch::Tensor value;
    torch::Tensor initial;
    Reduction reduction;
  };
  std::vector<State> states_;

  // Makes this metric's state tensors the very tensors of `leader` (same signature required).
  void alias_state_of(const Metric& leader);

  // Called first by every sync(): restores the local state if already synced, then keeps a copy of
  // it for unsync().
  void begin_sync();

 private:
  std::string name_;
  torch::Device device_;
  std::vector<torch::Tensor> local_state_;
};

// Helpers shared by the concrete metrics (device-side, no host synchronization).
namespace detail {
// Ratio with `zero_division` where the denominator is 0 (TorchMetrics' _safe_divide).
torch::Tensor safe_divide(const torch::Tensor& num, const torch::Tensor& den, double zero_division = 0.0);
// Applies the NaN strategy to per-element values and their weights (same shape).
std::pair<torch::Tensor, torch::Tensor> apply_nan_strategy(torch::Tensor value, torch::Tensor weight,
                                                           NanStrategy strategy, double replacement);
}  // namespace detail

}  // namespace strobe::metrics
