// lr_monitor (LearningRateMonitor): logs each parameter group's learning rate (`lr`, or
// `lr/<group>` for the groups of optimizer.param_groups; `lr/pg<i>` for a task's own optimizer's
// unnamed groups) every log interval. Learning rates are host values:
// they go straight to the loggers, never through the device.
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/callback.h"
#include "strobe/core/optim.h"
#include "strobe/core/trainer_view.h"

namespace strobe {
namespace {

class LearningRateMonitor : public Callback {
 public:
  std::string name() const override { return "lr_monitor"; }
  void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    auto* opt = t.optimizer();
    const int64_t step = t.state().global_step;
    if (!opt || step == logged_step_ || (step % t.config().log_every_n_steps != 0 && step != 1)) return;
    logged_step_ = step;
    std::vector<std::pair<std::string, double>> values;
    const size_t groups = opt->param_groups().size();
    const auto& names = t.param_group_names();
    for (size_t g = 0; g < groups; ++g)
      values.emplace_back(groups == 1 ? "lr" : names.size() == groups ? "lr/" + names[g] : fmt::format("lr/pg{}", g),
                          get_lr(*opt, g));
    t.log_host(values);
  }

 private:
  int64_t logged_step_ = -1;
};

std::shared_ptr<Callback> make_lr_monitor(config::Section& cfg) {
  cfg.finish();
  return std::make_shared<LearningRateMonitor>();
}

STROBE_REGISTER(callback_registry(), "lr_monitor", make_lr_monitor);

}  // namespace
}  // namespace strobe
