// A weighted mix of sources (data.sources, docs/DATA.md "Mixes"): one dataset whose index space is
// the sources' samples one after another, drawn in each epoch by a deterministic schedule.
//
// The schedule is a pure function of the position: position p goes to the source whose share is
// furthest behind its weight ("largest deficit", weights normalized to sum 1 and taken to 2^-20 of
// it, in integers; ties to the first source), so after any p positions every source has been drawn within one sample of weight x p,
// and any window of N consecutive positions holds weight x N samples of it, within two. Within a
// source, the epoch takes its samples in a permutation drawn from (seed, epoch, source) (in order
// without shuffling), each at most once. The epoch ends when the first source runs out: its length
// is the largest L at which no source is asked for more samples than it has. A source with more
// data than its share sees a fresh part of it each epoch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strobe/data/dataset.h"

namespace strobe::data {

struct MixSource {
  std::string name;
  double weight = 1;
  std::shared_ptr<const Dataset> data;
};

class MixDataset : public Dataset {
 public:
  // Weights > 0 and finite, every source non-empty (std::invalid_argument otherwise: the data module
  // names the config key before). `mix` false: the sources one after another, every sample once an
  // epoch in the sampler's permutation, the weights unused (a validation set of every source).
  explicit MixDataset(std::vector<MixSource> sources, bool mix = true);

  int64_t size() const override { return total_; }
  // The source's sample, with "source" (an int64 scalar: the source's index) added.
  Sample get(int64_t index, at::Generator& gen) const override;
  std::string describe(int64_t index) const override;
  std::vector<int64_t> epoch_order(uint64_t seed, int64_t epoch, bool shuffle) const override;
  int64_t epoch_order_size() const override { return mix_ ? epoch_length_ : -1; }
  int64_t sample_length(int64_t index) const override;

  const std::vector<MixSource>& sources() const { return sources_; }
  // The source of each of the epoch's first `length` positions (the schedule above).
  std::vector<int32_t> schedule(int64_t length) const;

 private:
  std::pair<size_t, int64_t> locate(int64_t index) const;  // (source, index within it)
  size_t next_source(const std::vector<int64_t>& counts, int64_t position) const;

  std::vector<MixSource> sources_;
  std::vector<int64_t> quanta_;  // the weights in 2^-20 of their sum
  int64_t quantum_sum_ = 0;
  std::vector<int64_t> offsets_;  // of each source in the index space
  int64_t total_ = 0, epoch_length_ = 0;
  bool mix_ = true;
};

}  // namespace strobe::data
