// example_loss_ema: a callback with state that must survive a resume. It keeps an exponential moving
// average of the training loss (ema = decay * ema + (1 - decay) * loss, in float64) and the number of
// batches it has seen, and prints both when training ends. The average stays a device tensor: no
// step reads it on the host. state_dict() (called only when a checkpoint is written) carries it into
// the checkpoint exactly (a float64 as JSON round-trips bit for bit), so a run stopped and resumed
// prints what the same run without the stop prints.
#include <cstdio>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/callback.h"
#include "strobe/core/trainer_view.h"

namespace strobe_example {

class LossEma : public strobe::Callback {
 public:
  explicit LossEma(double decay) : decay_(decay) {}
  std::string name() const override { return "example_loss_ema"; }

  void on_train_batch_end(strobe::TrainerView&, strobe::Module&, const torch::Tensor& loss, const strobe::Batch&,
                          int64_t) override {
    if (!loss.defined()) return;
    const auto l = loss.detach().to(torch::kFloat64);
    ema_ = ema_.defined() ? ema_.to(l.device()) * decay_ + l * (1.0 - decay_) : l.clone();
    ++batches_;
  }
  void on_train_end(strobe::TrainerView& t, strobe::Module&) override {
    if (t.is_global_zero())
      std::printf("example_loss_ema: %.17g after %lld batches\n", ema_.defined() ? ema_.item<double>() : 0.0,
                  static_cast<long long>(batches_));
  }
  nlohmann::json state_dict() const override {
    nlohmann::json s = {{"batches", batches_}, {"decay", decay_}};
    if (ema_.defined()) s["ema"] = ema_.item<double>();
    return s;
  }
  void load_state_dict(const nlohmann::json& s) override {
    batches_ = s.at("batches").get<int64_t>();
    if (s.contains("ema")) ema_ = torch::tensor(s.at("ema").get<double>(), torch::kFloat64);
  }

 private:
  double decay_;
  torch::Tensor ema_;  // undefined until the first batch
  int64_t batches_ = 0;
};

// callbacks: [{name: example_loss_ema, decay: 0.9}]
std::shared_ptr<strobe::Callback> make_loss_ema(strobe::config::Section& cfg) {
  const double decay = cfg.get_double("decay", 0.9, 0.0, 1.0);
  cfg.finish();
  return std::make_shared<LossEma>(decay);
}
STROBE_REGISTER(strobe::callback_registry(), "example_loss_ema", make_loss_ema);

}  // namespace strobe_example
