// strobe tune lr: the learning-rate range test (Lightning's Tuner.lr_find; docs/CONFIG.md "tune").
// A fresh build of the run's model, data and optimizer trains `steps` optimizer steps while the
// learning rate grows exponentially from `min_lr` to `max_lr` (the lr_range schedule, optim.h); the
// loss of each step is smoothed (beta 0.98, bias-corrected as Lightning does it) and the sweep stops
// once the smoothed loss passes 4x the best. The suggestion is the learning rate where the smoothed
// loss falls fastest (the minimum of torch.gradient against the learning rates, the first 10 points
// and the last left out): Lightning's rule, so the same recorded sequence gives the same answer.
// Writes OUT/lr_find.csv and OUT/lr_find.svg; no checkpoint, log, capture or run directory.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace strobe {

struct LrFindError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct LrFindOptions {
  std::vector<std::string> configs, sets, plugins;
  double min_lr = 1e-8, max_lr = 1.0;
  int64_t steps = 100;
  std::string out = "lr_find";  // the folder of lr_find.csv and lr_find.svg
  std::string apply;            // a copy of the config with the suggestion as optimizer.lr
  std::string from;             // an earlier lr_find.csv: suggest and plot from it, without training
  bool overwrite = false;       // replace OUT's lr_find.csv / lr_find.svg and --apply's file
};

struct LrCurve {
  std::vector<double> lrs, losses, smoothed;  // per optimizer step
};

// The index of the suggested learning rate in `lrs` (Lightning's rule on the smoothed losses);
// nullopt when fewer than two finite points remain after skipping.
std::optional<size_t> lr_suggestion(const std::vector<double>& lrs, const std::vector<double>& smoothed, int skip_begin = 10,
                                    int skip_end = 1);

// The command: returns its exit status; bad input throws LrFindError or config::ConfigError.
int run_lr_find(const LrFindOptions& options);

}  // namespace strobe
