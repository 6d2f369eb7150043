#pragma once
// MetricCollection: named metrics fed the same inputs, with TorchMetrics-style compute groups:
// metrics whose state_signature() match (accuracy / precision / recall / F1 of one task, classes,
// top_k, ignore_index) share one state, so one update serves them all — 1 confusion-matrix
// update per step instead of 4. Reset, state_dict, load_state_dict, to and sync act once per
// group. Keys of state_dict are "<metric name>.<state name>" of each group's first metric.
#include "strobe/metrics/metric.h"

#include <memory>
#include <string>
#include <vector>

namespace strobe::metrics {

class MetricCollection {
 public:
  // Names must be unique; a metric joins the group of the first one with the same signature.
  void add(const std::string& name, std::unique_ptr<Metric> metric);
  void update(const torch::Tensor& first, const torch::Tensor& second = torch::Tensor());
  std::vector<std::pair<std::string, torch::Tensor>> compute() const;  // in insertion order
  void reset();
  std::map<std::string, torch::Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, torch::Tensor>& state);
  void to(const torch::Device& device);
  void sync(c10d::ProcessGroup& group);
  void unsync();

  Metric& at(const std::string& name) const;
  size_t size() const { return entries_.size(); }
  size_t num_groups() const;

 private:
  struct Entry {
    std::string name;
    std::unique_ptr<Metric> metric;
    size_t leader;  // index of the entry whose state this one shares; itself for a group's first
  };
  bool is_leader(size_t i) const { return entries_[i].leader == i; }
  std::vector<Entry> entries_;
};

}  // namespace strobe::metrics
