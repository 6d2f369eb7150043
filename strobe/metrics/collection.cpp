#include "strobe/metrics/collection.h"

#include <algorithm>

namespace strobe::metrics {

void MetricCollection::add(const std::string& name, std::unique_ptr<Metric> metric) {
  TORCH_CHECK(metric, "MetricCollection::add('", name, "'): null metric");
  for (const auto& e : entries_) TORCH_CHECK(e.name != name, "MetricCollection: duplicate metric name '", name, "'");
  size_t leader = entries_.size();
  const std::string sig = metric->state_signature();
  if (!sig.empty()) {
    for (const auto& e : entries_) {
      if (is_leader(static_cast<size_t>(&e - entries_.data())) && e.metric->state_signature() == sig) {
        leader = e.leader;
        metric->alias_state_of(*e.metric);
        break;
      }
    }
  }
  entries_.push_back(Entry{name, std::move(metric), leader});
}

void MetricCollection::update(const torch::Tensor& first, const torch::Tensor& second) {
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (is_leader(i)) entries_[i].metric->update(first, second);
  }
}

std::vector<std::pair<std::string, torch::Tensor>> MetricCollection::compute() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& e : entries_) out.emplace_back(e.name, e.metric->compute());
  return out;
}

void MetricCollection::reset() {
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (is_leader(i)) entries_[i].metric->reset();
  }
}

std::map<std::string, torch::Tensor> MetricCollection::state_dict() const {
  std::map<std::string, torch::Tensor> out;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!is_leader(i)) continue;
    for (auto& [k, v] : entries_[i].metric->state_dict()) out.emplace(entries_[i].name + "." + k, v);
  }
  return out;
}

void MetricCollection::load_state_dict(const std::map<std::string, torch::Tensor>& state) {
  size_t used = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!is_leader(i)) continue;
    const std::string prefix = entries_[i].name + ".";
    std::map<std::string, torch::Tensor> mine;
    for (const auto& [k, v] : state) {
      if (k.compare(0, prefix.size(), prefix) == 0) mine.emplace(k.substr(prefix.size()), v);
    }
    used += mine.size();
    entries_[i].metric->load_state_dict(mine);
  }
  TORCH_CHECK(used == state.size(), "MetricCollection::load_state_dict: ", state.size() - used,
              " entries belong to no metric of this collection");
}

void MetricCollection::to(const torch::Device& device) {
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (is_leader(i)) entries_[i].metric->to(device);
  }
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!is_leader(i)) entries_[i].metric->alias_state_of(*entries_[entries_[i].leader].metric);
  }
}

void MetricCollection::sync(c10d::ProcessGroup& group) {
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (is_leader(i)) entries_[i].metric->sync(group);
  }
}

void MetricCollection::unsync() {
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (is_leader(i)) entries_[i].metric->unsync();
  }
}

Metric& MetricCollection::at(const std::string& name) const {
  auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
  TORCH_CHECK(it != entries_.end(), "MetricCollection: no metric named '", name, "'");
  return *it->metric;
}

size_t MetricCollection::num_groups() const {
  size_t n = 0;
  for (size_t i = 0; i < entries_.size(); ++i) n += is_leader(i);
  return n;
}

}  // namespace strobe::metrics
