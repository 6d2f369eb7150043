// Optimizers and learning-rate schedulers built from the `optimizer:` and `scheduler:` sections.
//
// Schedulers are pure functions of the optimizer-step count (plus, for reduce_on_plateau, the
// monitored values seen so far), so their whole state is a few numbers saved in the checkpoint.
// The learning rate of each parameter group is base_lr * factor(step); step() is called after every
// optimizer step (Lightning's interval "step").
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <torch/optim/optimizer.h>

#include "strobe/config/experiment.h"
#include "strobe/checkpoint/stateful.h"
#include "strobe/core/model.h"

namespace strobe {

// Whether a parameter name matches an optimizer.param_groups glob (fnmatch: `*`, `?`, `[...]`).
bool glob_matches(const std::string& glob, const std::string& name);

// One parameter group as optimizer.param_groups makes it (docs/CONFIG.md): its name ("default",
// "default/no_decay", "groups[0]", "groups[0]/no_decay"), its parameters' names and tensors (the
// optimizer's: under bf16-master the fp32 masters) and its hyper-parameters.
struct ParamGroup {
  std::string name;
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  double lr = 0, weight_decay = 0;
  double lr_scale = 1;  // layer_decay's multiplier (lr is the optimizer's or the entry's lr times it)
};

// The groups of the trainable parameters `named` (model order) under `cfg.param_groups`: each
// parameter in the first `groups` entry whose glob matches its name, else in the default group;
// within each, the ones `no_decay` selects (auto: at most one dimension, or named in the model's
// no_weight_decay(); or matching one of its globs) apart with weight decay 0. Under layer_decay
// the default group is split by the model's layers (Model::layer_of), layer i at lr x
// decay^(num_layers - 1 - i): "default/layer_<i>" and "default/layer_<i>/no_decay". Empty groups
// are left out. The parameters named in `frozen` (Freeze::names) sit apart in each group's
// "<group>/frozen" (and "<group>/no_decay/frozen") at unfreeze_lr_scale x its lr. A `groups` or
// `no_decay` glob that matches no parameter, or layer_decay with a model that declares no depth
// order (or none: `model` null), is a ConfigError naming it. Without param_groups: one group,
// "default", as before.
std::vector<ParamGroup> make_param_groups(const config::OptimizerConfig& cfg,
                                          const std::vector<std::pair<std::string, torch::Tensor>>& named,
                                          const Model* model, const std::set<std::string>& frozen = {});
// The groups as the run directory's param_groups.txt lists them: name, parameters, lr, weight decay,
// then each parameter's name.
std::string describe_param_groups(const std::vector<ParamGroup>& groups);

// `device` and the parameters decide whether optimizer.fused (default auto) selects the fused CUDA
// step; fused: true where it cannot be had is a ConfigError naming the key.
std::shared_ptr<torch::optim::Optimizer> build_optimizer(const config::OptimizerConfig& cfg, const std::vector<ParamGroup>& groups,
                                                         const torch::Device& device);

double get_lr(const torch::optim::Optimizer& opt, size_t group = 0);
void set_lr(torch::optim::Optimizer& opt, size_t group, double lr);

class LRScheduler : public Stateful {
 public:
  explicit LRScheduler(torch::optim::Optimizer& opt);
  virtual ~LRScheduler() = default;
  // After an optimizer step: step_count becomes `global_step` and the lrs are set for the next step.
  void step(int64_t global_step);
  // At the end of a validation run, with the monitored value (reduce_on_plateau only uses it).
  virtual void on_validation_end(double /*monitored*/) {}
  virtual bool wants_monitor() const { return false; }
  virtual std::string monitor() const { return ""; }
  virtual nlohmann::json state_dict() const;
  virtual void load_state_dict(const nlohmann::json& state);
  // Re-applies the lrs for the current step (after loading optimizer + scheduler state).
  void apply();
  // A callback that takes the schedule over (swa's annealing) sets each group's lr here: apply()
  // sets these instead of the schedule's from now on, while the schedule keeps counting steps (and
  // reduce_on_plateau its validations). Not part of the scheduler's state: the callback saves what
  // it needs and sets it again on resume. clear_override() hands the schedule back.
  void set_override(std::vector<double> lrs);
  void clear_override();
  bool overridden() const { return !override_.empty(); }
  size_t num_groups() const { return base_lrs_.size(); }
  // The schedule's length in optimizer steps where it depends on the run's (cosine: the step it
  // reaches its floor), else -1. It lives in the checkpoint: saved_length() is the loaded state's
  // (-1 before a load, or from a checkpoint that predates it), and a resume keeps it unless the run's
  // length was changed on purpose (Trainer::settle_schedule_length, docs/CONFIG.md "Resuming").
  virtual int64_t length() const { return -1; }
  virtual void set_length(int64_t) {}
  int64_t saved_length() const { return saved_length_; }
  // Stateful (the checkpoint's `scheduler` entry, a JSON blob): state_dict, with a step's start's
  // global step when asked for one.
  void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
  void load(const checkpoint::CheckpointData& in) override;

 protected:
  virtual double factor(int64_t step) const = 0;
  // The lowest lr apply() sets (reduce_on_plateau's min_lr); 0 for the others.
  virtual double lr_floor() const { return 0; }
  torch::optim::Optimizer& opt_;
  std::vector<double> base_lrs_;
  int64_t step_ = 0;
  int64_t saved_length_ = -1;
  std::vector<double> override_;
};

// Returns nullptr for `name: none`. `total_steps` is the run's number of optimizer steps when
// known (cosine uses it when `max_steps` is not given), or -1.
std::shared_ptr<LRScheduler> build_scheduler(const config::SchedulerConfig& cfg, torch::optim::Optimizer& opt,
                                             int64_t total_steps);

}  // namespace strobe
