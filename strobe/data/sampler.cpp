#include "strobe/data/sampler.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <stdexcept>

namespace strobe::data {

DistributedSampler::DistributedSampler(int64_t dataset_size, SamplerOptions options)
    : size_(dataset_size), opt_(options) {
  if (opt_.world_size < 1 || opt_.rank < 0 || opt_.rank >= opt_.world_size)
    throw std::invalid_argument("sampler: need 0 <= rank < world_size");
}

int64_t DistributedSampler::num_samples(int64_t epoch, int64_t offset) const {
  int64_t whole = size_ - static_cast<int64_t>(excluded(epoch).size());
  if (opt_.order) {  // a dataset's own order: its length, less the excluded indices it holds
    whole = opt_.order_size;
    if (const auto& ex = excluded(epoch); !ex.empty()) {
      if (!held_excluded_ || held_excluded_->first != epoch) {
        int64_t held = 0;
        for (int64_t i : epoch_indices(epoch)) held += std::binary_search(ex.begin(), ex.end(), i);
        held_excluded_ = std::make_pair(epoch, held);
      }
      whole -= held_excluded_->second;
    }
  }
  const int64_t size = whole - std::min(std::max<int64_t>(offset, 0), whole);
  if (opt_.world_size == 1) return size;
  if (opt_.drop_last) return size / opt_.world_size;
  return (size + opt_.world_size - 1) / opt_.world_size;
}

std::vector<int64_t> DistributedSampler::epoch_indices(int64_t epoch) const {
  if (opt_.order) return opt_.order(epoch);
  std::vector<int64_t> all(static_cast<size_t>(size_));
  std::iota(all.begin(), all.end(), 0);
  if (opt_.shuffle) {
    // std::mt19937_64 and a hand-written Fisher-Yates: the same order on every platform and library.
    std::mt19937_64 rng(opt_.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch) + 1);
    for (int64_t i = size_ - 1; i > 0; --i) {
      uint64_t j = rng() % static_cast<uint64_t>(i + 1);
      std::swap(all[i], all[j]);
    }
  }
  return all;
}

std::vector<int64_t> DistributedSampler::indices(int64_t epoch, int64_t offset) const {
  std::vector<int64_t> all = epoch_indices(epoch);
  if (const auto& ex = excluded(epoch); !ex.empty())
    all.erase(std::remove_if(all.begin(), all.end(), [&](int64_t i) { return std::binary_search(ex.begin(), ex.end(), i); }), all.end());
  if (offset > 0) all.erase(all.begin(), all.begin() + std::min<int64_t>(offset, static_cast<int64_t>(all.size())));
  const int64_t size = static_cast<int64_t>(all.size());
  if (opt_.world_size == 1) return all;
  int64_t per_rank = num_samples(epoch, offset);
  int64_t total = per_rank * opt_.world_size;
  if (!opt_.drop_last && size > 0) {
    for (int64_t i = size; i < total; ++i) all.push_back(all[(i - size) % size]);
  }
  std::vector<int64_t> mine;
  mine.reserve(per_rank);
  for (int64_t i = opt_.rank; i < total; i += opt_.world_size) mine.push_back(all[i]);
  return mine;
}

}  // namespace strobe::data
