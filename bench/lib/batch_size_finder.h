// strobe tune batch-size: the largest data.batch_size that trains (and validates) a few steps on the
// GPU without running out of memory (Lightning's Tuner.scale_batch_size; docs/CONFIG.md "strobe tune
// batch-size"). Each trial is a fresh `strobe` process (`--trial B`), so nothing a failed trial left
// in the caching allocator, a CUDA graph pool or the driver's context decides the next one.
#pragma once

#include <string>
#include <vector>

namespace strobe::bench {

struct BatchSizeOptions {
  std::vector<std::string> configs, sets, plugins;
  std::string mode = "power";    // power: double until a trial fails; binsearch: then bisect
  int64_t start = 0;             // the first trial's batch (0: the config's data.batch_size)
  int64_t max = 0;               // the largest batch to try (0: the training set's length)
  int64_t steps = 3;             // training steps a trial takes (after 2 validation batches)
  double memory_limit_gib = 0;   // cap the GPU as a smaller one would be (bench's --memory-limit-gib)
  std::string apply;             // a copy of the config with the answer as data.batch_size
  bool overwrite = false;
  int64_t trial = 0;             // > 0: this process is one trial of that batch (the finder starts it)
};

// The finder (or, with options.trial, one trial); returns the exit status. Bad input throws
// BenchUsageError or config::ConfigError.
int run_batch_size_finder(const BatchSizeOptions& options);

}  // namespace strobe::bench
