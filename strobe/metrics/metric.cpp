#include "strobe/metrics/metric.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>


namespace strobe::metrics {

size_t Metric::add_state(std::string name, torch::Tensor initial, Reduction reduction) {
  initial = initial.to(device_);
  states_.push_back(State{std::move(name), initial.clone(), initial, reduction});
  return states_.size() - 1;
}

void Metric::reset() {
  for (auto& s : states_) s.value.copy_(s.initial);
  local_state_.clear();
}

std::map<std::string, torch::Tensor> Metric::state_dict() const {
  std::map<std::string, torch::Tensor> out;
  for (const auto& s : states_) out.emplace(s.name, s.value.detach().clone());
  return out;
}

void Metric::load_state_dict(const std::map<std::string, torch::Tensor>& state) {
  for (auto& s : states_) {
    auto it = state.find(s.name);
    TORCH_CHECK(it != state.end(), "metric '", name_, "': state '", s.name, "' missing from the state dict");
    TORCH_CHECK(it->second.sizes() == s.value.sizes(), "metric '", name_, "': state '", s.name, "' has shape ",
                it->second.sizes(), ", expected ", s.value.sizes(),
                " (was the metric built with other options, e.g. num_classes or capacity?)");
    s.value.copy_(it->second);
  }
  TORCH_CHECK(state.size() == states_.size(), "metric '", name_, "': state dict has ", state.size(),
              " entries, expected ", states_.size());
  local_state_.clear();
}

void Metric::to(const torch::Device& device) {
  device_ = device;
  for (auto& s : states_) {
    s.value = s.value.to(device);
    s.initial = s.initial.to(device);
  }
  for (auto& t : local_state_) t = t.to(device);
}

void Metric::alias_state_of(const Metric& leader) {
  TORCH_CHECK(state_signature() == leader.state_signature() && !state_signature().empty() &&
                  states_.size() == leader.states_.size(),
              "metric '", name_, "' cannot share the state of '", leader.name_, "'");
  for (size_t i = 0; i < states_.size(); ++i) states_[i].value = leader.states_[i].value;
  device_ = leader.device_;
  local_state_.clear();
}

void Metric::begin_sync() {
  // Re-syncing an already synced state would count the other ranks twice: start from the local one.
  if (!local_state_.empty()) {
    for (size_t i = 0; i < states_.size(); ++i) states_[i].value.copy_(local_state_[i]);
    return;
  }
  for (const auto& s : states_) local_state_.push_back(s.value.clone());
}

void Metric::unsync() {
  if (local_state_.empty()) return;
  for (size_t i = 0; i < states_.size(); ++i) states_[i].value.copy_(local_state_[i]);
  local_state_.clear();
}

void Metric::sync(c10d::ProcessGroup& group) {
  begin_sync();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (auto& s : states_) {
    c10d::AllreduceOptions opts;
    switch (s.reduction) {
      case Reduction::kSum: opts.reduceOp = c10d::ReduceOp::SUM; break;
      case Reduction::kMin: opts.reduceOp = c10d::ReduceOp::MIN; break;
      case Reduction::kMax: opts.reduceOp = c10d::ReduceOp::MAX; break;
      case Reduction::kCat: TORCH_CHECK(false, "metric '", name_, "': gathered states need their own sync()");
    }
    TORCH_CHECK(s.value.is_contiguous(), "metric state must be contiguous");
    std::vector<torch::Tensor> tensors{s.value.view({-1})};
    works.push_back(group.allreduce(tensors, opts));
  }
  // NCCL: orders the current stream after the collectives (no host wait). Gloo: CPU tensors.
  for (auto& w : works) w->wait();
}

namespace detail {

torch::Tensor safe_divide(const torch::Tensor& num, const torch::Tensor& den, double zero_division) {
  auto n = num.is_floating_point() ? num : num.to(torch::kFloat);
  auto d = den.is_floating_point() ? den : den.to(torch::kFloat);
  return n.div(d).masked_fill(d == 0, zero_division);
}

std::pair<torch::Tensor, torch::Tensor> apply_nan_strategy(torch::Tensor value, torch::Tensor weight,
                                                           NanStrategy strategy, double replacement) {
  if (strategy == NanStrategy::kPropagate) return {std::move(value), std::move(weight)};
  auto bad = value.isnan().logical_or(weight.isnan());
  if (strategy == NanStrategy::kIgnore) {
    return {value.masked_fill(bad, 0.0), weight.masked_fill(bad, 0.0)};
  }
  return {value.masked_fill(bad, replacement), weight.masked_fill(bad, 1.0)};
}

}  // namespace detail
}  // namespace strobe::metrics
