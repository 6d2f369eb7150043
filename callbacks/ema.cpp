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

#include "callbacks/weight_averages.h"
#include "strobe/core/callback.h"
#include "strobe/core/step_record.h"

namespace strobe {
namespace {

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
    avg_.bind(t);
    if (avg_.empty()) avg_.reset_to_weights();  // else resumed from a checkpoint that holds them
  }

  void on_before_zero_grad(TrainerView& t, Module&, torch::optim::Optimizer&) override {
    if (avg_.empty()) return;
    const int64_t step = t.state().global_step + 1;  // the step just taken
    if (step % every_ != 0) return;
    avg_.update(1.0 - decay_at(step / every_ - 1), t.step_access().step_pipeline().last().skipped);
  }

  void on_validation_start(TrainerView& t, Module& module) override {
    if (!validate_ || avg_.empty() || t.sanity_checking()) return;
    avg_.swap_in(module);  // the model's own tensors (bf16 under bf16-master) hold the averages
  }

  void on_validation_end(TrainerView&, Module&) override { avg_.restore(); }

  void on_save_checkpoint(TrainerView&, Module&, checkpoint::CheckpointData& d) override { avg_.save(d); }

  void on_load_checkpoint(TrainerView& t, Module&, const checkpoint::CheckpointData& d) override {
    // Checked whole before any is taken: a missing, integer or mis-shaped average names its tensor.
    if (!avg_.load(t, d) && t.is_global_zero())
      fmt::print("strobe fit: ema: {} holds no weight average; the average starts from the resumed weights\n", d.source);
  }

 private:
  double decay_;
  bool warmup_;
  int64_t every_;
  bool validate_;
  WeightAverages avg_{"ema/"};
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
