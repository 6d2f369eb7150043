// A plugin as a user writes one: a model of its own and a callback, one STROBE_REGISTER line each.
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "framework/core/callback.h"
#include "framework/core/model.h"
#include "framework/core/trainer_view.h"

namespace plugin_good {

// x + W2(silu(W1 x) * V x) over the flattened image, then a linear head.
class GatedMlp : public strobe::Model {
 public:
  GatedMlp(int64_t in, int64_t hidden, int64_t classes) : strobe::Model("PluginGatedMlp") {
    w1_ = register_module("w1", torch::nn::Linear(in, hidden));
    v_ = register_module("v", torch::nn::Linear(in, hidden));
    w2_ = register_module("w2", torch::nn::Linear(hidden, in));
    head_ = register_module("head", torch::nn::Linear(in, classes));
  }
  torch::Tensor forward(const strobe::Batch& batch) override {
    auto x = input(batch.at("image")).flatten(1);
    x = x + w2_->forward(torch::silu(w1_->forward(x)) * v_->forward(x));
    return head_->forward(x);
  }
  std::string default_task() const override { return "classification"; }

 private:
  torch::nn::Linear w1_{nullptr}, v_{nullptr}, w2_{nullptr}, head_{nullptr};
};

std::shared_ptr<strobe::Model> make_gated_mlp(strobe::config::Section& cfg) {
  const int64_t in = cfg.get_int("in_features", 64, 1);
  const int64_t hidden = cfg.get_int("hidden", 32, 1);
  const int64_t classes = cfg.get_int("num_classes", 4, 2);
  cfg.finish();
  return std::make_shared<GatedMlp>(in, hidden, classes);
}
STROBE_REGISTER(strobe::model_registry(), "plugin_gated_mlp", make_gated_mlp);

// Counts optimizer steps; the count is checkpointed through state_dict.
class StepCounter : public strobe::Callback {
 public:
  std::string name() const override { return "plugin_step_counter"; }
  void on_train_batch_end(strobe::TrainerView& t, strobe::Module&, const torch::Tensor&, const strobe::Batch&, int64_t) override {
    if (t.accumulated_batches() == 0) ++steps_;
  }
  void on_train_end(strobe::TrainerView& t, strobe::Module&) override {
    if (t.is_global_zero()) std::printf("plugin_step_counter: %lld steps\n", static_cast<long long>(steps_));
  }
  nlohmann::json state_dict() const override { return {{"steps", steps_}}; }
  void load_state_dict(const nlohmann::json& s) override { steps_ = s.at("steps").get<int64_t>(); }

 private:
  int64_t steps_ = 0;
};
std::shared_ptr<strobe::Callback> make_step_counter(strobe::config::Section& cfg) {
  cfg.finish();
  return std::make_shared<StepCounter>();
}
STROBE_REGISTER(strobe::callback_registry(), "plugin_step_counter", make_step_counter);

}  // namespace plugin_good
