// Dataset: random access to samples. All randomness of a sample (augmentation, synthetic content)
// comes from the generator passed to get(), which the loader seeds from (seed, epoch, index) — so a
// sample does not depend on num_workers, on which worker made it, or on whether the run resumed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>

#include "strobe/data/batch.h"

namespace strobe::data {

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual Sample get(int64_t index, at::Generator& gen) const = 0;
  // Where sample `index` comes from, for a person (the image file of image_folder); "" when the
  // index alone says it. `strobe predict` writes it beside each prediction.
  virtual std::string describe(int64_t /*index*/) const { return ""; }
  // A dataset that orders its epochs itself (a weighted mix of sources: mix.h): the epoch's order of
  // indices, a pure function of (seed, epoch, shuffle), epoch_order_size() long; the sampler then
  // splits it over the ranks instead of permuting every index. -1: the sampler's permutation.
  virtual int64_t epoch_order_size() const { return -1; }
  virtual std::vector<int64_t> epoch_order(uint64_t /*seed*/, int64_t /*epoch*/, bool /*shuffle*/) const { return {}; }
  // The tokens sample `index` holds, read without making it (what packing places into rows:
  // data.packing, docs/DATA.md); -1: this dataset does not know.
  virtual int64_t sample_length(int64_t /*index*/) const { return -1; }
};

// Turns samples into a batch; must set batch.meta["batch_size"].
using CollateFn = std::function<Batch(std::vector<Sample>&)>;

// True while a loader that pins its batches (a run on a GPU) calls a collate: the collate may then
// allocate its outputs in pinned memory itself (stack_collate does), which spares the loader its copy
// of the batch into pinned memory (tensors already pinned are kept as they are).
bool collate_pins();

// Stacks each key along a new first dimension (all samples must have the same keys and shapes).
Batch stack_collate(std::vector<Sample>& samples);

// A view of the first `count` (or the indices `indices`) items of another dataset.
class SubsetDataset : public Dataset {
 public:
  SubsetDataset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices);
  int64_t size() const override { return static_cast<int64_t>(indices_.size()); }
  Sample get(int64_t index, at::Generator& gen) const override;
  std::string describe(int64_t index) const override { return base_->describe(indices_.at(index)); }
  int64_t sample_length(int64_t index) const override { return base_->sample_length(indices_.at(index)); }

 private:
  std::shared_ptr<const Dataset> base_;
  std::vector<int64_t> indices_;
};

// Generator for sample `index` of `epoch` under `seed` (SplitMix64 over the three).
at::Generator sample_generator(uint64_t seed, int64_t epoch, int64_t index);

}  // namespace strobe::data
