// swa: stochastic weight averaging (Lightning's StochasticWeightAveraging, torch.optim.swa_utils'
// AveragedModel + SWALR + update_bn), docs/CONFIG.md "swa".
//
// From epoch `swa_epoch_start` to the last (trainer.max_epochs - 1) the callback owns the learning
// rate: at each of those epochs' start it sets every parameter group's lr through the scheduler's
// override (LRScheduler::set_override; the configured schedule keeps counting steps) to SWALR's
// value for the epoch, annealing from the lr the group had when SWA began to its `swa_lrs` over
// `annealing_epochs` (cos or linear), as Lightning's SWALR stepped once an epoch. At each of those
// epochs' end (after its last optimizer step, before the validation it triggers) the fp32 average of
// every parameter and floating buffer takes the weights in: avg += (w - avg) / (n + 1), n the
// epochs averaged so far, on the device (one multi-tensor launch on CUDA). At the last epoch's end
// the BatchNorm statistics of the averages are recomputed by one forward pass over the training data
// in training mode with a cumulative average (torch's update_bn), before that epoch's validation and
// checkpoints. Validation during SWA runs on the averages; checkpoints hold them as `swa/<name>`;
// `strobe export --swa` writes them.
#include <cmath>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "callbacks/weight_averages.h"
#include "strobe/config/config.h"
#include "strobe/core/callback.h"
#include "strobe/core/optim.h"

namespace strobe {
namespace {

struct SwaOptions {
  std::vector<double> swa_lrs;      // one for every group, or one per group
  bool start_is_fraction = false;   // swa_epoch_start as a fraction of max_epochs
  int64_t start_epoch = 0;
  double start_fraction = 0;
  int64_t annealing_epochs = 10;
  bool cosine = true;
  bool validate = true;
};

// A BatchNorm layer's handles: its running statistics are recomputed for the averages.
struct Norm {
  std::string name;
  torch::nn::BatchNormImplBase<1, torch::nn::BatchNorm1dImpl>* b1 = nullptr;
  torch::nn::BatchNormImplBase<2, torch::nn::BatchNorm2dImpl>* b2 = nullptr;
  torch::nn::BatchNormImplBase<3, torch::nn::BatchNorm3dImpl>* b3 = nullptr;
  std::optional<double>& momentum() { return b1 ? b1->options.momentum() : b2 ? b2->options.momentum() : b3->options.momentum(); }
  bool tracks() { return b1 ? b1->options.track_running_stats() : b2 ? b2->options.track_running_stats() : b3->options.track_running_stats(); }
  void reset() { b1 ? b1->reset_running_stats() : b2 ? b2->reset_running_stats() : b3->reset_running_stats(); }
  torch::Tensor& tracked() { return b1 ? b1->num_batches_tracked : b2 ? b2->num_batches_tracked : b3->num_batches_tracked; }
};

class StochasticWeightAveraging : public Callback {
 public:
  StochasticWeightAveraging(SwaOptions o, config::Section cfg) : o_(std::move(o)), cfg_(std::move(cfg)) {}
  std::string name() const override { return "swa"; }

  void setup(TrainerView& t, Module&, Stage stage) override {
    if (stage != Stage::Fit) return;
    const int64_t max_epochs = t.config().max_epochs;
    if (max_epochs <= 0)
      cfg_.fail("swa_epoch_start", "swa averages up to the last epoch: set trainer.max_epochs (it is unlimited)");
    start_ = o_.start_is_fraction ? static_cast<int64_t>(static_cast<double>(max_epochs) * o_.start_fraction) : o_.start_epoch;
    last_ = max_epochs - 1;
    if (start_ > last_)
      cfg_.fail("swa_epoch_start", fmt::format("epoch {} is past the last epoch, {} (trainer.max_epochs {}; epochs count from 0)",
                                               start_, last_, max_epochs));
  }

  void on_fit_start(TrainerView& t, Module&) override {
    avg_.bind(t);
    const size_t groups = t.optimizer() ? t.optimizer()->param_groups().size() : 0;
    if (o_.swa_lrs.size() != 1 && o_.swa_lrs.size() != groups)
      cfg_.fail("swa_lrs", fmt::format("{} learning rates for {} parameter groups (one for all, or one per group in "
                                       "optimizer.param_groups' order)", o_.swa_lrs.size(), groups));
    // A resume inside SWA: the schedule is taken over again at the lr it had (state_dict).
    if (!start_lrs_.empty() && t.state().epoch >= start_) set_lrs(t, t.state().epoch);
  }

  void on_train_epoch_start(TrainerView& t, Module&) override {
    const int64_t epoch = t.state().epoch;
    if (epoch < start_ || !t.optimizer()) return;
    if (start_lrs_.empty()) {  // SWA begins: each group anneals from the lr it has now
      for (size_t g = 0; g < t.optimizer()->param_groups().size(); ++g) start_lrs_.push_back(get_lr(*t.optimizer(), g));
      if (t.is_global_zero())
        fmt::print("strobe fit: swa: averaging from epoch {} to {}; the learning rate anneals to {} over {} epoch(s)\n", start_,
                   last_, fmt::join(o_.swa_lrs, ", "), o_.annealing_epochs);
    }
    set_lrs(t, epoch);
  }

  void on_train_batch_end(TrainerView& t, Module& module, const torch::Tensor&, const Batch&, int64_t) override {
    const int64_t epoch = t.state().epoch;
    if (!t.state().epoch_done || epoch < start_ || epoch > last_) return;
    if (avg_.empty()) {
      avg_.reset_to_weights();
      averaged_ = 1;
    } else {
      avg_.update(1.0 / static_cast<double>(averaged_ + 1), torch::Tensor());
      ++averaged_;
    }
    bn_updated_ = false;
    if (epoch == last_) update_batch_norm(t, module);
  }

  void on_validation_start(TrainerView& t, Module& module) override {
    if (!o_.validate || avg_.empty() || t.sanity_checking()) return;
    avg_.swap_in(module);
  }

  void on_validation_end(TrainerView&, Module&) override { avg_.restore(); }

  nlohmann::json state_dict() const override {
    return {{"start_lrs", start_lrs_}, {"averaged", averaged_}, {"bn_updated", bn_updated_}};
  }
  void load_state_dict(const nlohmann::json& s) override {
    start_lrs_ = s.value("start_lrs", std::vector<double>{});
    averaged_ = s.value("averaged", int64_t{0});
    bn_updated_ = s.value("bn_updated", false);
  }

  void on_save_checkpoint(TrainerView&, Module&, checkpoint::CheckpointData& d) override { avg_.save(d); }

  // Checked whole; a checkpoint from before SWA began holds none.
  void on_load_checkpoint(TrainerView& t, Module&, const checkpoint::CheckpointData& d) override { avg_.load(t, d); }

 private:
  // SWALR's lr for `epoch`: the k-th epoch of SWA (k = epoch - start) anneals with t = k / A
  // (A = annealing_epochs; t = 1 at once for A = 0), lr = swa_lr * a + start_lr * (1 - a), a = t
  // (linear) or (1 - cos(pi t)) / 2 (cos).
  void set_lrs(TrainerView& t, int64_t epoch) {
    const int64_t k = epoch - start_;
    const double x = o_.annealing_epochs == 0 ? 1.0 : std::min(1.0, static_cast<double>(k) / static_cast<double>(o_.annealing_epochs));
    const double a = o_.cosine ? (1.0 - std::cos(M_PI * x)) / 2.0 : x;
    std::vector<double> lrs;
    for (size_t g = 0; g < start_lrs_.size(); ++g) {
      const double swa_lr = o_.swa_lrs.size() == 1 ? o_.swa_lrs[0] : o_.swa_lrs[g];
      lrs.push_back(swa_lr * a + start_lrs_[g] * (1.0 - a));
    }
    if (LRScheduler* s = t.scheduler()) {
      s->set_override(std::move(lrs));
    } else {
      for (size_t g = 0; g < lrs.size(); ++g) set_lr(*t.optimizer(), g, lrs[g]);
    }
  }

  // torch.optim.swa_utils.update_bn on the averages: each BatchNorm's running statistics reset and
  // recomputed as a cumulative average (momentum None) over one pass of the training data, in
  // training mode without gradients; the results replace the averages' statistics, and the model's
  // own tensors are restored bitwise.
  void update_batch_norm(TrainerView& t, Module& module) {
    std::vector<Norm> norms;
    for (const auto& m : module.net().named_modules()) {
      Norm n{m.key()};
      if (auto* b = m.value()->as<torch::nn::BatchNorm1d>()) n.b1 = b;
      else if (auto* b2 = m.value()->as<torch::nn::BatchNorm2d>()) n.b2 = b2;
      else if (auto* b3 = m.value()->as<torch::nn::BatchNorm3d>()) n.b3 = b3;
      else continue;
      if (n.tracks()) norms.push_back(n);
    }
    if (norms.empty() || avg_.empty()) return;
    torch::NoGradGuard ng;
    avg_.swap_in(module);
    std::vector<std::optional<double>> momenta;
    std::vector<torch::Tensor> tracked;
    for (auto& n : norms) {
      momenta.push_back(n.momentum());
      tracked.push_back(n.tracked().clone());
      n.momentum() = std::nullopt;
      n.reset();
    }
    const bool was_training = module.net().is_training();
    module.net().train();
    const int64_t batches = t.forward_over_training_data(last_ + 1);
    if (!was_training) module.net().eval();
    for (size_t j = 0; j < norms.size(); ++j) norms[j].momentum() = momenta[j], norms[j].tracked().copy_(tracked[j]);
    // The recomputed statistics into the averages (they are the model's floating buffers).
    const auto& names = avg_.names();
    for (size_t i = 0; i < names.size(); ++i)
      for (const auto& n : norms)
        if (names[i] == n.name + ".running_mean" || names[i] == n.name + ".running_var") avg_.averages()[i].copy_(avg_.live()[i]);
    avg_.restore();
    bn_updated_ = true;
    if (t.is_global_zero())
      fmt::print("strobe fit: swa: the averages' BatchNorm statistics recomputed over {} training batch(es) ({} layer(s))\n",
                 batches, norms.size());
  }

  SwaOptions o_;
  config::Section cfg_;
  int64_t start_ = 0, last_ = 0;
  std::vector<double> start_lrs_;
  int64_t averaged_ = 0;
  bool bn_updated_ = false;
  WeightAverages avg_{"swa/"};
};

std::shared_ptr<Callback> make_swa(config::Section& cfg) {
  SwaOptions o;
  if (!cfg.has("swa_lrs")) cfg.fail("swa_lrs", "required: the learning rate SWA anneals to (a number, or one per parameter group)");
  const YAML::Node lrs = cfg.node()["swa_lrs"];
  if (lrs.IsSequence()) {
    cfg.accept("swa_lrs");
    for (const auto& v : lrs) {
      const std::string text = v.IsScalar() ? v.Scalar() : "";
      if (!config::is_float_text(text) && !config::is_int_text(text))
        cfg.fail("swa_lrs", fmt::format("expected numbers, got '{}'", config::shown(text)));
      o.swa_lrs.push_back(std::stod(text));
    }
    if (o.swa_lrs.empty()) cfg.fail("swa_lrs", "an empty list (give a number, or one per parameter group)");
  } else {
    o.swa_lrs.push_back(cfg.get_double("swa_lrs", 0.0));
  }
  for (double lr : o.swa_lrs)
    if (!std::isfinite(lr) || lr <= 0) cfg.fail("swa_lrs", fmt::format("{} is not a positive learning rate", lr));
  const std::string start = cfg.has("swa_epoch_start") && !cfg.is_null("swa_epoch_start") ? cfg.node()["swa_epoch_start"].Scalar() : "0.8";
  cfg.accept("swa_epoch_start");
  if (config::is_int_text(start)) {
    o.start_epoch = std::stoll(start);
    if (o.start_epoch < 0) cfg.fail("swa_epoch_start", "expected an epoch (0, 1, ...) or a fraction of max_epochs in (0, 1)");
  } else if (config::is_float_text(start)) {
    o.start_is_fraction = true;
    o.start_fraction = std::stod(start);
    if (!(o.start_fraction > 0 && o.start_fraction < 1))
      cfg.fail("swa_epoch_start", fmt::format("{} is neither an epoch (0, 1, ...) nor a fraction of max_epochs in (0, 1)", start));
  } else {
    cfg.fail("swa_epoch_start", fmt::format("expected an epoch or a fraction, got '{}'", config::shown(start)));
  }
  o.annealing_epochs = cfg.get_int("annealing_epochs", 10, 0);
  o.cosine = cfg.get_choice("annealing_strategy", "cos", {"cos", "linear"}) == "cos";
  o.validate = cfg.get_bool("validate", true);
  cfg.finish();
  return std::make_shared<StochasticWeightAveraging>(std::move(o), cfg);
}

STROBE_REGISTER(callback_registry(), "swa", make_swa);

}  // namespace
}  // namespace strobe
