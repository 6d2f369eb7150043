// A plugin whose components misbehave at run time: a callback that throws what is not a
// std::exception (`throw 42;`) from a hook, and a model whose depth order (num_layers, layer_of) or
// training FLOPs are wrong. Strobe reports each in one line instead of terminating or allocating without bound.
#include <string>

#include <torch/torch.h>

#include "strobe/strobe.h"

namespace misbehaving {

class ThrowsInt : public strobe::Callback {
 public:
  explicit ThrowsInt(int64_t at) : at_(at) {}
  std::string name() const override { return "misbehaving_throws_int"; }
  void on_train_batch_start(strobe::TrainerView& t, strobe::Module&, const strobe::Batch&, int64_t) override {
    if (t.state().global_step == at_) throw 42;
  }

 private:
  int64_t at_;
};
std::shared_ptr<strobe::Callback> make_throws_int(strobe::config::Section& cfg) {
  const int64_t at = cfg.get_int("at_step", 2, 0);
  cfg.finish();
  return std::make_shared<ThrowsInt>(at);
}
STROBE_REGISTER(strobe::callback_registry(), "misbehaving_throws_int", make_throws_int);

// A linear classifier that declares `num_layers` layers and puts its weight in layer `weight_layer`.
class BadLayers : public strobe::Model {
 public:
  BadLayers(int64_t in, int64_t classes, int64_t layers, int64_t weight_layer, double flops)
      : strobe::Model("BadLayers"), layers_(layers), weight_layer_(weight_layer), flops_(flops) {
    fc_ = register_module("fc", torch::nn::Linear(in, classes));
  }
  torch::Tensor forward(const strobe::Batch& batch) override { return fc_->forward(input(batch.at("image")).flatten(1)); }
  std::string default_task() const override { return "classification"; }
  int64_t num_layers() const override { return layers_; }
  int64_t layer_of(const std::string& param) const override { return param == "fc.weight" ? weight_layer_ : 0; }
  double training_flops(const strobe::Batch&) const override { return flops_; }

 private:
  int64_t layers_, weight_layer_;
  double flops_;
  torch::nn::Linear fc_{nullptr};
};
std::shared_ptr<strobe::Model> make_bad_layers(strobe::config::Section& cfg) {
  const int64_t in = cfg.get_int("in_features", 64, 1);
  const int64_t classes = cfg.get_int("num_classes", 4, 2);
  const int64_t layers = cfg.get_int("layers", 2, 1);
  const int64_t weight_layer = cfg.get_int("weight_layer", 1);
  const double flops = std::stod(cfg.get_string("flops", "0"));  // what training_flops declares ("inf", "-1": wrong)
  cfg.get_int("hidden", 16, 1);  // the plugin tests' config has it: unused
  cfg.finish();
  return std::make_shared<BadLayers>(in, classes, layers, weight_layer, flops);
}
STROBE_REGISTER(strobe::model_registry(), "misbehaving_bad_layers", make_bad_layers);

}  // namespace misbehaving
