#include "strobe/logging/log_collector.h"

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/checkpoint_keys.h"
#include "strobe/logging/device_readback.h"

namespace strobe::logging {

struct LogCollector::Slot {
  DeviceReadback values;  // the stacked values, copied to pinned memory when the device is CUDA
  int64_t step = 0, epoch = 0;
  std::vector<std::string> names;
  bool busy = false;
};

LogCollector::LogCollector(torch::Device device, int64_t ring_slots) : device_(device) {
  for (int64_t i = 0; i < ring_slots; ++i) ring_.push_back(std::make_unique<Slot>());
}

LogCollector::~LogCollector() = default;

void LogCollector::log(const std::string& name, const torch::Tensor& value, const LogOptions& o, int64_t batch_size) {
  bool on_step = o.on_step.value_or(training_);
  bool on_epoch = o.on_epoch.value_or(!training_);
  auto v = value.detach();
  if (v.numel() != 1) throw std::runtime_error(fmt::format("log('{}'): expected a scalar tensor, got shape {}", name, c10::str(v.sizes())));
  v = v.reshape({}).to(torch::kFloat32);
  std::string step_name = on_step && on_epoch ? name + "_step" : name;
  std::string epoch_name = on_step && on_epoch ? name + "_epoch" : name;
  if (on_step) {
    auto& acc = step_values_[step_name];
    acc.sum = acc.n == 0 ? v : acc.sum + v;
    ++acc.n;
  }
  if (on_epoch) {
    auto& acc = epoch_values_[epoch_name];
    auto weighted = v * static_cast<double>(batch_size);
    acc.sum = acc.sum.defined() ? acc.sum.add_(weighted) : weighted;
    acc.count += static_cast<double>(batch_size);
  }
}

bool LogCollector::ready(const Slot& s) const { return s.values.ready(); }

void LogCollector::enqueue(int64_t step, int64_t epoch, std::vector<std::string> names, std::vector<torch::Tensor> values) {
  if (names.empty()) return;
  Slot& s = *ring_[next_slot_];
  next_slot_ = (next_slot_ + 1) % ring_.size();
  if (s.busy) {
    // The ring is full: deliver the oldest rows (this slot's among them) before reusing it.
    while (s.busy) {
      Slot* oldest = pending_.front();
      oldest->values.wait();
      deliver(*oldest);
    }
  }
  s.values.start(torch::stack(values));
  s.step = step, s.epoch = epoch, s.names = std::move(names), s.busy = true;
  pending_.push_back(&s);
}

void LogCollector::deliver(Slot& s) {
  MetricRow row;
  row.step = s.step, row.epoch = s.epoch;
  const float* p = s.values.host().data_ptr<float>();
  for (size_t i = 0; i < s.names.size(); ++i) {
    row.values.emplace_back(s.names[i], static_cast<double>(p[i]));
    latest_[s.names[i]] = p[i];
    latest_step_[s.names[i]] = s.step;
  }
  s.busy = false;
  pending_.pop_front();
  for (auto* c : consumers_) c->consume(row);
}

void LogCollector::end_step(int64_t step, int64_t epoch, bool emit) {
  if (emit && !step_values_.empty()) {
    std::vector<std::string> names;
    std::vector<torch::Tensor> values;
    for (auto& kv : step_values_)
      names.push_back(kv.first), values.push_back(kv.second.n == 1 ? kv.second.sum : kv.second.sum / static_cast<double>(kv.second.n));
    enqueue(step, epoch, std::move(names), std::move(values));
  }
  step_values_.clear();
  poll();
}

std::pair<std::vector<torch::Tensor>, torch::Tensor> LogCollector::reduced_epoch_values() const {
  // One all-reduce for all names: [sum_0 .. sum_n-1, count_0 .. count_n-1] in float64 (the counts
  // are host numbers; on the device they cost no synchronization).
  std::vector<torch::Tensor> sums;
  std::vector<double> counts;
  for (const auto& kv : epoch_values_) {
    sums.push_back(kv.second.sum.to(torch::kFloat64).reshape({1}));
    counts.push_back(kv.second.count);
  }
  const auto opts = torch::TensorOptions().dtype(torch::kFloat64).device(device_);
  auto count_t = torch::tensor(counts, torch::TensorOptions().dtype(torch::kFloat64)).to(device_);
  auto packed = sums.empty() ? torch::zeros({0}, opts) : torch::cat({torch::cat(sums), count_t});
  reduce_sum_(packed);
  const int64_t n = static_cast<int64_t>(sums.size());
  std::vector<torch::Tensor> out;
  size_t i = 0;
  for (const auto& kv : epoch_values_) out.push_back(packed[static_cast<int64_t>(i++)].to(kv.second.sum.scalar_type()));
  return {out, packed.narrow(0, n, n)};
}

void LogCollector::end_epoch(int64_t step, int64_t epoch, bool wait) {
  std::vector<std::string> names;
  std::vector<torch::Tensor> values;
  if (reduce_sum_) {
    auto [sums, counts] = reduced_epoch_values();
    size_t i = 0;
    for (auto& kv : epoch_values_) {
      names.push_back(kv.first);
      values.push_back(sums[i] / counts[static_cast<int64_t>(i)].to(sums[i].scalar_type()));
      ++i;
    }
  } else {
    for (auto& kv : epoch_values_) {
      names.push_back(kv.first);
      values.push_back(kv.second.sum / kv.second.count);
    }
  }
  epoch_values_.clear();
  enqueue(step, epoch, std::move(names), std::move(values));
  if (wait)
    drain();
  else
    poll();
}

void LogCollector::discard_epoch() {
  epoch_values_.clear();
  step_values_.clear();
}

void LogCollector::save_state(checkpoint::CheckpointData& out) const {
  nlohmann::json counts = nlohmann::json::object(), steps = nlohmann::json::object();
  if (reduce_sum_ && !local_save_) {
    // Every rank's share (a checkpoint is written by rank 0; the host read is the checkpoint's own).
    auto [sums, count_t] = reduced_epoch_values();
    auto host_counts = count_t.to(torch::kCPU);
    size_t i = 0;
    for (const auto& [name, acc] : epoch_values_) {
      out.tensors["logger/epoch/" + name] = sums[i];
      counts[name] = host_counts[static_cast<int64_t>(i)].item<double>();
      ++i;
    }
  } else {
    for (const auto& [name, acc] : epoch_values_) {
      out.tensors["logger/epoch/" + name] = acc.sum;
      counts[name] = acc.count;
    }
  }
  for (const auto& [name, acc] : step_values_) {
    out.tensors["logger/step/" + name] = acc.sum;
    steps[name] = acc.n;
  }
  out.blobs[checkpoint_keys::kLogger] = nlohmann::json{{"epoch_counts", counts}, {"step_counts", steps}}.dump();
}

void LogCollector::load_state(const checkpoint::CheckpointData& in) {
  epoch_values_.clear();
  step_values_.clear();
  if (!in.has_blob(checkpoint_keys::kLogger)) return;  // a checkpoint of an older build: epoch means restart
  auto j = nlohmann::json::parse(in.blob(checkpoint_keys::kLogger));
  for (const auto& [name, count] : j.at("epoch_counts").items()) {
    auto sum = in.tensor("logger/epoch/" + name).to(device_);
    // Data parallel: the saved sums are every rank's; rank 0 carries them on, the others add theirs.
    if (reduce_sum_ && !primary_)
      epoch_values_[name] = EpochAcc{torch::zeros_like(sum), 0.0};
    else
      epoch_values_[name] = EpochAcc{sum, count.get<double>()};
  }
  for (const auto& [name, n] : j.at("step_counts").items())
    step_values_[name] = StepAcc{in.tensor("logger/step/" + name).to(device_), n.get<int64_t>()};
}

void LogCollector::emit_host(int64_t step, int64_t epoch, const std::vector<std::pair<std::string, double>>& values) {
  MetricRow row{step, epoch, values};
  for (const auto& kv : values) latest_[kv.first] = kv.second, latest_step_[kv.first] = step;
  for (auto* c : consumers_) c->consume(row);
}

void LogCollector::poll() {
  while (!pending_.empty() && ready(*pending_.front())) deliver(*pending_.front());
}

void LogCollector::drain() {
  while (!pending_.empty()) {
    Slot* s = pending_.front();
    s->values.wait();
    deliver(*s);
  }
  for (auto* c : consumers_) c->flush();
}

}  // namespace strobe::logging
