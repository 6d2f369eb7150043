#include "framework/logging/log_collector.h"

#include "framework/checkpoint/checkpoint_io.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace strobe::logging {

struct LogCollector::Slot {
  torch::Tensor host;  // pinned when the device is CUDA
  std::unique_ptr<c10::Event> event;
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

bool LogCollector::ready(const Slot& s) const { return !s.event || s.event->query(); }

void LogCollector::enqueue(int64_t step, int64_t epoch, std::vector<std::string> names, std::vector<torch::Tensor> values) {
  if (names.empty()) return;
  Slot& s = *ring_[next_slot_];
  next_slot_ = (next_slot_ + 1) % ring_.size();
  if (s.busy) {
    // The ring is full: deliver the oldest rows (this slot's among them) before reusing it.
    while (s.busy) {
      Slot* oldest = pending_.front();
      if (oldest->event) oldest->event->synchronize();
      deliver(*oldest);
    }
  }
  auto packed = torch::stack(values);
  const int64_t k = packed.numel();
  if (!s.host.defined() || s.host.numel() < k) {
    auto opts = torch::TensorOptions().dtype(torch::kFloat32).pinned_memory(device_.is_cuda());
    s.host = torch::empty({std::max<int64_t>(k, 32)}, opts);
  }
  s.host.narrow(0, 0, k).copy_(packed, /*non_blocking=*/device_.is_cuda());
  if (device_.is_cuda()) {
    if (!s.event) s.event = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    auto impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    s.event->record(impl->getStream(device_));
  }
  s.step = step, s.epoch = epoch, s.names = std::move(names), s.busy = true;
  pending_.push_back(&s);
}

void LogCollector::deliver(Slot& s) {
  MetricRow row;
  row.step = s.step, row.epoch = s.epoch;
  const float* p = s.host.data_ptr<float>();
  for (size_t i = 0; i < s.names.size(); ++i) {
    row.values.emplace_back(s.names[i], static_cast<double>(p[i]));
    latest_[s.names[i]] = p[i];
  }
  s.busy = false;
  pending_.pop_front();
  ++delivered_;
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

void LogCollector::end_epoch(int64_t step, int64_t epoch, bool wait) {
  std::vector<std::string> names;
  std::vector<torch::Tensor> values;
  for (auto& kv : epoch_values_) {
    names.push_back(kv.first);
    values.push_back(kv.second.sum / kv.second.count);
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
  for (const auto& [name, acc] : epoch_values_) {
    out.tensors["logger/epoch/" + name] = acc.sum;
    counts[name] = acc.count;
  }
  for (const auto& [name, acc] : step_values_) {
    out.tensors["logger/step/" + name] = acc.sum;
    steps[name] = acc.n;
  }
  out.blobs["logger"] = nlohmann::json{{"epoch_counts", counts}, {"step_counts", steps}}.dump();
}

void LogCollector::load_state(const checkpoint::CheckpointData& in) {
  epoch_values_.clear();
  step_values_.clear();
  if (!in.has_blob("logger")) return;  // a checkpoint of an older build: epoch means restart
  auto j = nlohmann::json::parse(in.blob("logger"));
  for (const auto& [name, count] : j.at("epoch_counts").items())
    epoch_values_[name] = EpochAcc{in.tensor("logger/epoch/" + name).to(device_), count.get<double>()};
  for (const auto& [name, n] : j.at("step_counts").items())
    step_values_[name] = StepAcc{in.tensor("logger/step/" + name).to(device_), n.get<int64_t>()};
}

void LogCollector::emit_host(int64_t step, int64_t epoch, const std::vector<std::pair<std::string, double>>& values) {
  MetricRow row{step, epoch, values};
  for (const auto& kv : values) latest_[kv.first] = kv.second;
  for (auto* c : consumers_) c->consume(row);
}

void LogCollector::poll() {
  while (!pending_.empty() && ready(*pending_.front())) deliver(*pending_.front());
}

void LogCollector::drain() {
  while (!pending_.empty()) {
    Slot* s = pending_.front();
    if (s->event) s->event->synchronize();
    deliver(*s);
  }
  for (auto* c : consumers_) c->flush();
}

CsvLogger::CsvLogger(std::string path, int64_t keep_until_step) : path_(std::move(path)) {
  if (keep_until_step < 0 || !std::filesystem::exists(path_)) {
    rewrite();
    return;
  }
  std::ifstream in(path_);
  std::string header;
  std::getline(in, header);
  std::vector<std::string> cols;
  std::stringstream hs(header);
  for (std::string c; std::getline(hs, c, ',');) cols.push_back(c);
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::stringstream ls(line);
    for (std::string c; std::getline(ls, c, ',');) cells.push_back(c);
    if (cells.size() < 2) continue;
    MetricRow r;
    r.step = std::stoll(cells[0]);
    r.epoch = std::stoll(cells[1]);
    if (r.step > keep_until_step) continue;
    for (size_t i = 2; i < cells.size() && i < cols.size(); ++i)
      if (!cells[i].empty()) r.values.emplace_back(cols[i], std::stod(cells[i]));
    for (auto& kv : r.values)
      if (std::find(columns_.begin(), columns_.end(), kv.first) == columns_.end()) columns_.push_back(kv.first);
    rows_.push_back(std::move(r));
  }
  std::sort(columns_.begin(), columns_.end());
  rewrite();
}

std::string CsvLogger::format_row(const MetricRow& row) const {
  std::string line = fmt::format("{},{}", row.step, row.epoch);
  for (const auto& c : columns_) {
    line += ',';
    for (const auto& kv : row.values)
      if (kv.first == c) {
        line += fmt::format("{:.9g}", kv.second);
        break;
      }
  }
  return line + "\n";
}

void CsvLogger::rewrite() {
  std::filesystem::create_directories(std::filesystem::path(path_).parent_path());
  std::string tmp = path_ + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "step,epoch";
    for (const auto& c : columns_) out << ',' << c;
    out << '\n';
    for (const auto& r : rows_) out << format_row(r);
  }
  std::filesystem::rename(tmp, path_);
  written_ = rows_.size();
}

void CsvLogger::consume(const MetricRow& row) {
  bool widened = false;
  for (const auto& kv : row.values)
    if (std::find(columns_.begin(), columns_.end(), kv.first) == columns_.end()) columns_.push_back(kv.first), widened = true;
  rows_.push_back(row);
  if (widened) {
    std::sort(columns_.begin(), columns_.end());
    rewrite();
    return;
  }
  std::ofstream out(path_, std::ios::app);
  for (; written_ < rows_.size(); ++written_) out << format_row(rows_[written_]);
}

void CsvLogger::flush() {}

}  // namespace strobe::logging
