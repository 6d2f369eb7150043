#include "strobe/data/mix.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <random>
#include <stdexcept>

#include <fmt/format.h>
#include <torch/torch.h>

namespace strobe::data {

MixDataset::MixDataset(std::vector<MixSource> sources, bool mix) : sources_(std::move(sources)), mix_(mix) {
  if (sources_.empty()) throw std::invalid_argument("a mix needs at least one source");
  double sum = 0;
  for (const auto& s : sources_) {
    if (!(s.weight > 0) || !std::isfinite(s.weight))
      throw std::invalid_argument(fmt::format("source {}: weight {} is not a finite number > 0", s.name, s.weight));
    if (!s.data || s.data->size() == 0) throw std::invalid_argument(fmt::format("source {} has no samples", s.name));
    sum += s.weight;
  }
  // The weights as integer parts of 2^20 of their sum (at least 1): the schedule then compares
  // integers, so it is the same on every machine, ties included.
  for (const auto& s : sources_) {
    quanta_.push_back(std::max<int64_t>(1, std::llround(s.weight / sum * static_cast<double>(int64_t{1} << 20))));
    quantum_sum_ += quanta_.back();
    offsets_.push_back(total_);
    total_ += s.data->size();
  }
  // The largest L whose schedule asks no source for more than it has: count along the schedule
  // until the first source would be asked once more than it holds.
  std::vector<int64_t> counts(sources_.size(), 0);
  int64_t p = 0;
  for (;; ++p) {
    const size_t best = next_source(counts, p);
    if (counts[best] == sources_[best].data->size()) break;
    ++counts[best];
  }
  epoch_length_ = p;
}

size_t MixDataset::next_source(const std::vector<int64_t>& counts, int64_t p) const {
  // The source furthest below its share of p + 1 samples: the largest q (p + 1) - c Q (ties: the first).
  size_t best = 0;
  int64_t deficit = INT64_MIN;
  for (size_t s = 0; s < quanta_.size(); ++s) {
    const int64_t d = quanta_[s] * (p + 1) - counts[s] * quantum_sum_;
    if (d > deficit) deficit = d, best = s;
  }
  return best;
}

std::vector<int32_t> MixDataset::schedule(int64_t length) const {
  std::vector<int32_t> out(static_cast<size_t>(length));
  std::vector<int64_t> counts(sources_.size(), 0);
  for (int64_t p = 0; p < length; ++p) {
    const size_t best = next_source(counts, p);
    ++counts[best];
    out[static_cast<size_t>(p)] = static_cast<int32_t>(best);
  }
  return out;
}

std::vector<int64_t> MixDataset::epoch_order(uint64_t seed, int64_t epoch, bool shuffle) const {
  const auto plan = schedule(epoch_length_);
  // Each source's order in this epoch: a permutation drawn from (seed, epoch, source), as the
  // sampler draws its own (std::mt19937_64 and a hand-written Fisher-Yates: the same on every platform).
  std::vector<std::vector<int64_t>> orders(sources_.size());
  for (size_t s = 0; s < sources_.size(); ++s) {
    auto& o = orders[s];
    o.resize(static_cast<size_t>(sources_[s].data->size()));
    for (size_t i = 0; i < o.size(); ++i) o[i] = static_cast<int64_t>(i);
    if (!shuffle) continue;
    std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch) * 0xBF58476D1CE4E5B9ull +
                        static_cast<uint64_t>(s) + 1);
    for (int64_t i = static_cast<int64_t>(o.size()) - 1; i > 0; --i) std::swap(o[i], o[rng() % static_cast<uint64_t>(i + 1)]);
  }
  std::vector<int64_t> out;
  out.reserve(plan.size());
  std::vector<size_t> next(sources_.size(), 0);
  for (int32_t s : plan) out.push_back(offsets_[s] + orders[s][next[s]++]);
  return out;
}

std::pair<size_t, int64_t> MixDataset::locate(int64_t index) const {
  const auto it = std::upper_bound(offsets_.begin(), offsets_.end(), index);
  const size_t s = static_cast<size_t>(it - offsets_.begin()) - 1;
  return {s, index - offsets_[s]};
}

Sample MixDataset::get(int64_t index, at::Generator& gen) const {
  const auto [s, i] = locate(index);
  Sample out = sources_[s].data->get(i, gen);
  out["source"] = torch::scalar_tensor(static_cast<int64_t>(s), torch::kInt64);
  return out;
}

std::string MixDataset::describe(int64_t index) const {
  const auto [s, i] = locate(index);
  const std::string inner = sources_[s].data->describe(i);
  return fmt::format("source {}: {}", sources_[s].name, inner.empty() ? fmt::format("sample {}", i) : inner);
}

int64_t MixDataset::sample_length(int64_t index) const {
  const auto [s, i] = locate(index);
  return sources_[s].data->sample_length(i);
}

}  // namespace strobe::data
