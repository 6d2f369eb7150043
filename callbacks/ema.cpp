// ema: an exponential moving average of the weights (Lightning's EMAWeightAveraging, timm's
// ModelEmaV3), docs/CONFIG.md "ema".
//
// After every `every_n_steps`-th optimizer step (on_before_zero_grad, outside a captured CUDA graph)
// the fp32 average of each parameter and floating buffer moves toward the weights the checkpoint
// holds (bf16-master: the fp32 masters): avg += (1 - d) * (w - avg), one multi-tensor launch on CUDA
// (strobe::ema_update_) that reads the step pipeline's skip flag on the device, so a step that was
// not applied (NaN capture's skip_step, an fp16 overflow, the sticky guard after a non-finite step)
// moves nothing and nothing waits for the host. The k-th update (k = 0, 1, ...) uses d = 0 for k = 0
// (the average starts as the weights after the first update) and then `decay`, or with `warmup`
// (default) timm's min(decay, 1 - (1 + k)^(-2/3)). k follows from the global step, so a resumed run
// continues exactly. With `validate` (default) validation runs on the averaged weights (cast-copied
// into the model, restored bitwise after) and logs val/... as Lightning does. Checkpoints hold the
// averages as `ema/<name>`; `strobe export --ema` writes them.
#include <cmath>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/callback.h"
#include "strobe/core/checkpoint_view.h"
#include "strobe/core/module.h"
#include "strobe/core/step_record.h"
#include "strobe/core/trainer_view.h"

#if STROBE_HAS_OPS
#include "strobe/ops/ops.h"
#endif

namespace strobe {
namespace {

constexpr const char* kEmaPrefix = "ema/";

class EmaWeights : public Callback {
 public:
  EmaWeights(double decay, bool warmup, int64_t every_n_steps, bool validate)
      : decay_(decay), warmup_(warmup), every_(every_n_steps), validate_(validate) {}
  std::string name() const override { return "ema"; }

  // The decay of the k-th update (0-based).
  double decay_at(int64_t k) const {
    if (k <= 0) return 0.0;
    if (!warmup_) return decay_;
    return std::min(decay_, 1.0 - std::pow(1.0 + static_cast<double>(k), -2.0 / 3.0));
  }

  void on_fit_start(TrainerView& t, Module&) override {
    bind(t);
    if (!averages_.empty()) return;  // resumed from a checkpoint that holds them
    torch::NoGradGuard ng;
    for (size_t i = 0; i < sources_.size(); ++i)
      averages_.push_back(sources_[i].to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true));
  }

  void on_before_zero_grad(TrainerView& t, Module&, torch::optim::Optimizer&) override {
    if (averages_.empty()) return;
    const int64_t step = t.state().global_step + 1;  // the step just taken
    if (step % every_ != 0) return;
    const double weight = 1.0 - decay_at(step / every_ - 1);
    const torch::Tensor& skipped = t.step_access().step_pipeline().last().skipped;
    torch::NoGradGuard ng;
#if STROBE_HAS_OPS
    ops::ema_update_(averages_, sources_, weight, skipped.defined() ? skipped.to(averages_[0].device()) : torch::Tensor());
#else
    const torch::Tensor w = skipped.defined() ? (1 - skipped) * weight : torch::full({}, weight);
    for (size_t i = 0; i < averages_.size(); ++i) averages_[i].add_((sources_[i].to(torch::kFloat32) - averages_[i]) * w);
#endif
  }

  void on_validation_start(TrainerView& t, Module& module) override {
    if (!validate_ || averages_.empty() || t.sanity_checking()) return;
    // The model's own tensors (bf16 under bf16-master), kept and overwritten with the averages.
    torch::NoGradGuard ng;
    live_ = model_tensors(module);
    backup_.clear();
    for (size_t i = 0; i < live_.size(); ++i) {
      backup_.push_back(live_[i].clone());
      live_[i].copy_(averages_[i]);
    }
  }

  void on_validation_end(TrainerView&, Module&) override {
    if (backup_.empty()) return;
    torch::NoGradGuard ng;
    for (size_t i = 0; i < live_.size(); ++i) live_[i].copy_(backup_[i]);
    backup_.clear(), live_.clear();
  }

  void on_save_checkpoint(TrainerView&, Module&, checkpoint::CheckpointData& d) override {
    for (size_t i = 0; i < averages_.size(); ++i) d.tensors[kEmaPrefix + names_[i]] = averages_[i];
  }

  void on_load_checkpoint(TrainerView& t, Module&, const checkpoint::CheckpointData& d) override {
    bind(t);
    std::map<std::string, torch::Tensor> weights;
    for (size_t i = 0; i < names_.size(); ++i) weights.emplace(names_[i], sources_[i]);
    // Checked whole before any is taken: a missing, integer or mis-shaped average names its tensor.
    const auto averages = CheckpointView(d, d.source).weight_averages(kEmaPrefix, weights);
    if (averages.empty()) {
      if (t.is_global_zero())
        fmt::print("strobe fit: ema: {} holds no weight average; the average starts from the resumed weights\n", d.source);
      return;
    }
    std::vector<torch::Tensor> loaded;
    for (size_t i = 0; i < names_.size(); ++i)
      loaded.push_back(averages.at(names_[i]).to(sources_[i].device(), torch::kFloat32).contiguous(sources_[i].suggest_memory_format()));
    averages_ = std::move(loaded);
  }

 private:
  // The averaged tensors' names and sources, in the view's order.
  void bind(TrainerView& t) {
    if (!names_.empty()) return;
    for (auto& [name, tensor] : t.weights()) {
      names_.push_back(name);
      sources_.push_back(tensor);
    }
  }

  // The model's parameters and floating buffers in the order of names_.
  std::vector<torch::Tensor> model_tensors(Module& module) const {
    std::map<std::string, torch::Tensor> all;
    for (const auto& p : module.net().named_parameters()) all[p.key()] = p.value();
    for (const auto& b : module.net().named_buffers()) all[b.key()] = b.value();
    std::vector<torch::Tensor> out;
    for (const auto& n : names_) out.push_back(all.at(n));
    return out;
  }

  double decay_;
  bool warmup_;
  int64_t every_;
  bool validate_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> sources_, averages_, live_, backup_;
};

std::shared_ptr<Callback> make_ema(config::Section& cfg) {
  const double decay = cfg.get_double("decay", 0.999, 0.0, 1.0);
  if (decay >= 1.0) cfg.fail("decay", "expected a decay below 1 (1 would never move the average)");
  const bool warmup = cfg.get_bool("warmup", true);
  const int64_t every = cfg.get_int("every_n_steps", 1, 1);
  const bool validate = cfg.get_bool("validate", true);
  cfg.finish();
  return std::make_shared<EmaWeights>(decay, warmup, every, validate);
}

STROBE_REGISTER(callback_registry(), "ema", make_ema);

}  // namespace
}  // namespace strobe
