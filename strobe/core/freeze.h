// optimizer.param_groups.freeze (docs/CONFIG.md): parameters that train only from the start of
// epoch `unfreeze_at_epoch` (Lightning's BackboneFinetuning; never, without it).
//
// The frozen parameters are in the optimizer from the start, in their own groups (make_param_groups
// puts them in "<group>/frozen" at unfreeze_lr_scale x the group's lr); while frozen they do not
// require gradients, so autograd makes none, the step's gradient pass skips them and the optimizer
// creates no state for them. What is built from the parameters that take gradients is rebuilt at
// the unfreeze (update()): the data-parallel reducer, and the captured CUDA graph (captured anew
// after the warm-up steps). The state follows the epoch alone, so a run resumed on either side of
// the unfreeze continues exactly. FitLoop calls update() at each epoch's start and before each
// training batch (a resumed run or a replay brings it to its restored epoch there).
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <torch/types.h>

#include "strobe/config/experiment.h"

namespace torch::nn {
class Module;
}

namespace strobe {

class GraphedRunner;
namespace distributed {
class Strategy;
}

class Freeze {
 public:
  // The trainable parameters of `net` that a `freeze` glob selects; with train_bn (the default) a
  // BatchNorm layer's own parameters are not frozen (the layer trains, statistics included); without
  // it a BatchNorm layer among the selected ones (its weight or running_mean matches) runs in eval
  // mode while frozen. A glob that matches no trainable parameter is a ConfigError naming it.
  Freeze(const config::OptimizerConfig& cfg, torch::nn::Module& net);

  const std::set<std::string>& names() const { return names_; }
  int64_t unfreeze_at_epoch() const { return unfreeze_at_; }
  bool frozen_at(int64_t epoch) const { return unfreeze_at_ < 0 || epoch < unfreeze_at_; }
  bool frozen() const { return frozen_; }
  // Sets the selected parameters' requires_grad for `epoch`; true when that changed something.
  bool apply(int64_t epoch);
  // After net.train(): the frozen BatchNorm layers (train_bn: false) back in eval mode.
  void set_modes();

  // What update() rebuilds at a change: the data-parallel strategy (null: one process), the graphed
  // runner (null: eager steps); `rank` prints the unfreeze's line on rank 0.
  void attach(torch::nn::Module& net, distributed::Strategy* strategy, GraphedRunner* graphed, int64_t rank) {
    net_ = &net, strategy_ = strategy, graphed_ = graphed, rank_ = rank;
  }
  // apply(epoch), and at a change the reducer and the captured graph rebuilt; then set_modes().
  void update(int64_t epoch);

 private:
  torch::nn::Module* net_ = nullptr;
  distributed::Strategy* strategy_ = nullptr;
  GraphedRunner* graphed_ = nullptr;
  int64_t rank_ = 0;
  std::set<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::vector<std::shared_ptr<torch::nn::Module>> frozen_bn_;
  int64_t unfreeze_at_ = -1;
  bool frozen_ = false;
};

}  // namespace strobe
