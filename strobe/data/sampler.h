// Sampler: the order of indices in an epoch. The permutation is a pure function of (seed, epoch),
// so a resumed run sees the same order; with world_size > 1 each rank takes a disjoint stride of it
// (padded by wrapping when drop_last is false, like torch's DistributedSampler), and the ranks
// together cover every index.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace strobe::data {

struct SamplerOptions {
  bool shuffle = true;
  bool drop_last = false;  // distributed: drop the tail instead of padding it
  uint64_t seed = 0;
  int64_t rank = 0;
  int64_t world_size = 1;
  // data.exclude (sorted dataset indices): left out of the order of epochs >= exclude_from_epoch;
  // earlier epochs leave out `exclude_before` (the set a resumed checkpoint's epoch ran with). The
  // permutation is drawn over every index first, so the rest keep their relative order.
  std::vector<int64_t> exclude, exclude_before;
  int64_t exclude_from_epoch = 0;
  // A dataset's own order of each epoch (Dataset::epoch_order: a mix of sources), order_size long,
  // in place of the permutation of every index; unset: the permutation.
  std::function<std::vector<int64_t>(int64_t epoch)> order;
  int64_t order_size = -1;
};

class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, SamplerOptions options);
  // This rank's indices of `epoch`; from `offset`: the epoch's order after its first `offset` samples
  // (all ranks together), split as a whole epoch is (a resume that changed the batch mid-epoch).
  std::vector<int64_t> indices(int64_t epoch, int64_t offset = 0) const;
  int64_t num_samples(int64_t epoch = 0, int64_t offset = 0) const;  // per rank in `epoch` (from `offset`)
  const std::vector<int64_t>& excluded(int64_t epoch) const {
    return epoch >= opt_.exclude_from_epoch ? opt_.exclude : opt_.exclude_before;
  }

 private:
  std::vector<int64_t> epoch_indices(int64_t epoch) const;  // the epoch's whole order, before exclusion

  int64_t size_;
  SamplerOptions opt_;
  // A dataset's own order under data.exclude: how many excluded indices the epoch's order holds.
  mutable std::optional<std::pair<int64_t, int64_t>> held_excluded_;
};

}  // namespace strobe::data
