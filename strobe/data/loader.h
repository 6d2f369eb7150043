// DataLoader: batches of an epoch, in order, made by worker threads into a bounded prefetch queue.
//
// Contract: batch i of epoch e is a pure function of (dataset, seed, e, i) — independent of
// num_workers and of where the epoch was started (start(e, first_batch) resumes mid-epoch without
// replaying). With pin_memory the batches come in page-locked memory so the host-to-device copy can
// be non-blocking. At most `num_workers * prefetch_factor` batches are held ahead of the consumer.
// With `lookahead` (a training loader, whose epochs follow one another), once every batch of the
// epoch is made or being made the workers go on with the next epoch's first batches, within the same
// bound; start(epoch + 1) from its first batch takes them over, so an epoch's first batch does not
// wait a worker's whole batch time. Any other start, or a change of the loader's settings, drops them.
// The worker threads, the queue and their locks live behind a pimpl (loader.cpp): a component that
// names a DataLoader (strobe/core/datamodule.h) includes no threading header through it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include <optional>

#include "strobe/data/dataset.h"
#include "strobe/data/sampler.h"

namespace strobe {
struct EngineAccess;
}

namespace strobe::data {

struct LoaderOptions {
  int64_t batch_size = 32;
  bool shuffle = true;
  bool drop_last = false;
  int64_t num_workers = 0;  // 0: batches are made on the calling thread
  int64_t prefetch_factor = 2;
  bool pin_memory = false;
  uint64_t seed = 0;
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t limit_batches = -1;  // -1: the whole epoch
  // data.exclude: dataset indices to leave out, by split ("train", "val", "test"); this loader's
  // split picks its set (a DataModule's evaluation loaders set theirs).
  std::map<std::string, std::vector<int64_t>> exclude;
  std::string split = "train";
  std::string exclude_file;  // where the sets came from (messages)
  // data.packing: best_fit: > 0 packs each epoch's samples into rows of this many tokens
  // (strobe/data/packing.h) and a batch is batch_size rows; the epoch's position, num_batches and the
  // split over ranks count rows. 0: a batch is batch_size samples.
  int64_t pack_row_len = 0;
  bool lookahead = false;  // make the next epoch's first batches at the end of an epoch (above)
};

struct RowPlan;

class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, CollateFn collate, LoaderOptions options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  int64_t num_batches() const;  // in the current (or, before start, the first) epoch on this rank (after limit_batches)
  int64_t num_batches(int64_t epoch) const;
  // The data.exclude set in effect in `epoch`.
  const std::vector<int64_t>& excluded(int64_t epoch) const { return sampler_.excluded(epoch); }
  const LoaderOptions& options() const { return opt_; }
  const Dataset& dataset() const { return *dataset_; }

  // Begins epoch `epoch` at batch `first_batch` (stops any epoch in progress). sample_offset: the
  // epoch's batches are cut from its order after that many samples (all ranks together; a resume
  // that changed the batch mid-epoch), and num_batches() counts them until the next start.
  void start(int64_t epoch, int64_t first_batch = 0, int64_t sample_offset = 0);
  // The next batch of the current epoch, or nullopt at its end. Rethrows a worker's exception.
  std::optional<Batch> next();
  // Batch `batch_index` of `epoch`, made on the calling thread (used by replay and tests).
  Batch make_batch(int64_t epoch, int64_t batch_index) const;
  // The first `count` samples of `epoch`'s order as one batch, made on the calling thread (a memory
  // trial before training: runner/step_memory.h).
  Batch make_first_samples(int64_t epoch, int64_t count) const;
  void stop();

 private:
  // The trainer's settings (strobe/core/engine_access.h): the limits, pinning and shuffling of the
  // run, and data.exclude on resume (this loader's set applies from `epoch` on; earlier epochs leave
  // out `before`, what the checkpoint's epoch ran with).
  friend struct strobe::EngineAccess;
  void exclude_from(int64_t epoch, std::vector<int64_t> before);
  void set_limit_batches(int64_t limit) {
    settings_changed();
    opt_.limit_batches = limit;
  }
  void set_pin_memory(bool pin) {
    settings_changed();
    opt_.pin_memory = pin;
  }
  void set_shuffle(bool shuffle);  // rebuilds the sampler (overfit_batches turns shuffling off)

  // This rank's units of `epoch` after the epoch's first `offset` (all ranks): sample indices, or
  // under packing the plan's rows.
  std::vector<int64_t> units(int64_t epoch, int64_t offset = 0) const;
  int64_t num_units(int64_t epoch, int64_t offset) const;
  std::shared_ptr<const RowPlan> plan(int64_t epoch) const;  // packing: the epoch's rows (cached)
  // The samples of the units [begin, end) of `order`.
  std::vector<int64_t> samples_of(int64_t epoch, const std::vector<int64_t>& order, int64_t begin, int64_t end) const;

  // Batch `batch_index` of `epoch` whose units are `order` (units(epoch, offset)).
  Batch make_batch_from(int64_t epoch, const std::vector<int64_t>& order, int64_t batch_index) const;
  int64_t batches_in(int64_t units) const;  // an epoch's batches of that many units (drop_last, limit_batches)
  void settings_changed();                  // stops the workers: what they made ahead no longer holds

  struct Impl;  // the epoch's order and position, the prefetch queue, the workers (loader.cpp)

  std::shared_ptr<const Dataset> dataset_;
  CollateFn collate_;
  LoaderOptions opt_;
  DistributedSampler sampler_;  // under packing: the epoch's whole order of samples (one rank's view)
  std::vector<int64_t> lengths_;  // packing: each sample's tokens
  std::unique_ptr<Impl> impl_;
};

}  // namespace strobe::data
