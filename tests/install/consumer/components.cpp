// Components written against the installed headers alone: a model, a metric and a callback with
// state, each registered with one STROBE_REGISTER line. tests/cli/plugins builds this file in the
// build tree too, as the plugin tests/cli/plugin_test.cpp trains.
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/strobe.h"

namespace consumer {

// A gated residual MLP: x + W2(silu(W1 x) * (V x)) over flattened images, then a linear head; the
// gate is Strobe's own operator (strobe::ops::swiglu over [W1 x, V x]), as a plugin calls it.
class GatedMlp : public strobe::Model {
 public:
  GatedMlp(int64_t in, int64_t hidden, int64_t classes) : strobe::Model("GatedMlp") {
    w1_ = register_module("w1", torch::nn::Linear(in, hidden));
    v_ = register_module("v", torch::nn::Linear(in, hidden));
    w2_ = register_module("w2", torch::nn::Linear(hidden, in));
    head_ = register_module("head", torch::nn::Linear(in, classes));
  }
  torch::Tensor forward(const strobe::Batch& batch) override {
    auto x = input(batch.at("image")).flatten(1);
    x = x + w2_->forward(strobe::ops::swiglu(torch::cat({w1_->forward(x), v_->forward(x)}, -1)));
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
STROBE_REGISTER(strobe::model_registry(), "consumer_gated_mlp", make_gated_mlp);

// Mean absolute error of (prediction, target).
class MeanAbsoluteError : public strobe::metrics::Metric {
 public:
  explicit MeanAbsoluteError(const strobe::metrics::MetricOptions& o) : Metric("consumer_mae", o.device) {
    sum_ = add_state("sum", torch::zeros({}, torch::TensorOptions(o.device).dtype(torch::kFloat64)), Reduction::kSum);
    count_ = add_state("count", torch::zeros({}, torch::TensorOptions(o.device).dtype(torch::kFloat64)), Reduction::kSum);
  }
  void update(const torch::Tensor& pred, const torch::Tensor& target) override {
    state(sum_) += (pred.to(torch::kFloat64) - target.to(torch::kFloat64)).abs().sum();
    state(count_) += static_cast<double>(pred.numel());
  }
  torch::Tensor compute() const override { return state(sum_) / state(count_); }

 private:
  size_t sum_ = 0, count_ = 0;
};
STROBE_REGISTER(strobe::metrics::metric_registry(), "consumer_mae", strobe::metrics::metric_factory<MeanAbsoluteError>());

// Counts the optimizer steps it has seen (checkpointed through state_dict), and reads each step's
// loss from the step's device record without stalling the step, as the built-in nan_capture reads
// its verdicts: the copy of step N is started at step N and collected at step N + 1.
class StepCounter : public strobe::Callback {
 public:
  std::string name() const override { return "consumer_step_counter"; }
  void on_train_batch_end(strobe::TrainerView& t, strobe::Module&, const torch::Tensor&, const strobe::Batch&,
                          int64_t) override {
    if (t.accumulated_batches() != 0) return;
    ++steps_;
    const std::vector<torch::Tensor>& losses = t.step_access().step_pipeline().last().losses;
    if (losses.empty()) return;
    collect();
    pending_.start(losses.back());
  }
  void on_train_end(strobe::TrainerView& t, strobe::Module&) override {
    collect();
    if (t.is_global_zero())
      std::printf("consumer_step_counter: %lld steps; the last step's loss read from the device: %.9g (%lld reads)\n",
                  static_cast<long long>(steps_), last_loss_, static_cast<long long>(reads_));
  }
  nlohmann::json state_dict() const override { return {{"steps", steps_}}; }
  void load_state_dict(const nlohmann::json& s) override { steps_ = s.at("steps").get<int64_t>(); }

 private:
  void collect() {
    if (!pending_.started()) return;
    last_loss_ = pending_.wait().item<double>();
    ++reads_;
    pending_ = strobe::DeviceReadback();
  }
  int64_t steps_ = 0, reads_ = 0;
  double last_loss_ = NAN;
  strobe::DeviceReadback pending_;
};
std::shared_ptr<strobe::Callback> make_step_counter(strobe::config::Section& cfg) {
  cfg.finish();
  return std::make_shared<StepCounter>();
}
STROBE_REGISTER(strobe::callback_registry(), "consumer_step_counter", make_step_counter);

}  // namespace consumer
