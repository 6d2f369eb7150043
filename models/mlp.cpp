// mlp: flatten + fully connected layers with ReLU and dropout. Small and fast: the model of unit
// tests and smoke runs, and a baseline for tabular or tiny image data.
// Keys: in_features (input size after flattening), hidden (list of widths, [64]), num_classes,
// dropout (0.0).
#include <fmt/format.h>
#include <torch/torch.h>

#include "models/flops.h"
#include "strobe/core/model.h"

namespace strobe {
namespace {

class Mlp : public Model {
 public:
  Mlp(int64_t in_features, const std::vector<int64_t>& hidden, int64_t num_classes, double dropout)
      : Model("Mlp"), in_features_(in_features), dropout_(dropout) {
    int64_t prev = in_features;
    for (size_t i = 0; i < hidden.size(); ++i) {
      layers_.push_back(register_module(fmt::format("fc{}", i), torch::nn::Linear(prev, hidden[i])));
      prev = hidden[i];
    }
    head_ = register_module("head", torch::nn::Linear(prev, num_classes));
  }

  torch::Tensor forward(const Batch& batch) override {
    auto x = input(batch.at("image")).flatten(1);
    TORCH_CHECK(x.size(1) == in_features_, "mlp: model.in_features is ", in_features_, " but the input has ", x.size(1),
                " features per sample");
    for (auto& l : layers_) {
      x = torch::relu(l->forward(x));
      if (dropout_ > 0) x = torch::dropout(x, dropout_, is_training());
    }
    return head_->forward(x);
  }
  std::string default_task() const override { return "classification"; }
  std::vector<std::string> batch_keys() const override { return {"image"}; }
  // Every Linear per sample; the first (its input is data) forward and weight gradient only.
  double training_flops(const Batch& batch) const override {
    const auto& first = layers_.empty() ? head_ : layers_.front();
    if (linear_weights_ < 0) linear_weights_ = models::linear_weight_params(*this);  // counted once: this runs every batch
    const double all = linear_weights_, in = static_cast<double>(first->weight.numel());
    return static_cast<double>(batch_samples(batch)) * (6 * all - 2 * in);
  }

 private:
  int64_t in_features_;
  mutable double linear_weights_ = -1;  // training_flops: counted on first use
  double dropout_;
  std::vector<torch::nn::Linear> layers_;
  torch::nn::Linear head_{nullptr};
};

std::shared_ptr<Model> make_mlp(config::Section& cfg) {
  int64_t in = cfg.get_int("in_features", 784, 1);
  auto hidden = cfg.get_int_list("hidden", {64});
  for (auto h : hidden)
    if (h < 1) cfg.fail("hidden", "expected positive layer widths");
  int64_t classes = cfg.get_int("num_classes", 10, 1);
  double dropout = cfg.get_double("dropout", 0.0, 0.0, 0.99);
  cfg.finish();
  return std::make_shared<Mlp>(in, hidden, classes, dropout);
}

STROBE_REGISTER(model_registry(), "mlp", make_mlp);

}  // namespace
}  // namespace strobe
