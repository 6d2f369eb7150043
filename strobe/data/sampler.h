// Sampler: the order of indices in an epoch. The permutation is a pure function of (seed, epoch),
// so a resumed run sees the same order; with world_size > 1 each rank takes a disjoint stride of it
// (padded by wrapping when drop_last is false, like torch's DistributedSampler), and the ranks
// together cover every index.
#pragma once

#include <cstdint>
#include <vector>

namespace strobe::data {

struct SamplerOptions {
  bool shuffle = true;
  bool drop_last = false;  // distributed: drop the tail instead of padding it
  uint64_t seed = 0;
  int64_t rank = 0;
  int64_t world_size = 1;
};

class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, SamplerOptions options);
  std::vector<int64_t> indices(int64_t epoch) const;  // this rank's indices
  int64_t num_samples() const;                         // per rank per epoch

 private:
  int64_t size_;
  SamplerOptions opt_;
};

}  // namespace strobe::data
