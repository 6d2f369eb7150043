// spiral_net: a classifier of 2-D points built for this example (no built-in model has its parts).
//
//   radial   polar features of each point: its radius r = sqrt(x^2 + y^2 - radius_floor) and, for K
//            learnable frequencies w_k, sin and cos of (w_k * r + angle) — a spiral arm is a line in
//            (r, angle), so these features make the arms separable.
//   blocks.i residual blocks: h + fc2(gelu(fc1(norm(h)))).
//   head     one logit per class.
//
// radius_floor is the example's switchable fault: 0 (the default) is the true radius; a floor above
// the smallest squared radius in the data makes sqrt of a negative number, NaN, for the points nearest
// the centre — in the first training batch that holds one. NaN capture stops there, and `strobe replay`
// names the op (aten::sqrt) and this module (radial): its code runs under ModuleScope("radial"), so
// the replay's tracer attributes ops that touch no parameter to it as well.
#include <cmath>

#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/forensics.h"
#include "strobe/core/model.h"

namespace strobe_example {

class RadialFeaturesImpl : public torch::nn::Module {
 public:
  RadialFeaturesImpl(int64_t frequencies, double radius_floor) : radius_floor_(radius_floor) {
    // Frequencies 1..K (in turns of the spiral's 4*pi per unit radius), learnable from there.
    freq_ = register_parameter("freq", torch::linspace(1.0, 4.0 * M_PI, frequencies));
  }
  torch::Tensor forward(const torch::Tensor& xy) {
    strobe::ModuleScope scope("radial");
    auto x = xy.select(1, 0), y = xy.select(1, 1);
    auto r = torch::sqrt(x * x + y * y - radius_floor_);
    auto angle = torch::atan2(y, x);
    auto phase = r.unsqueeze(1) * freq_.unsqueeze(0) + angle.unsqueeze(1);
    return torch::cat({xy, r.unsqueeze(1), torch::sin(phase), torch::cos(phase)}, 1);
  }
  int64_t out_features() const { return 3 + 2 * freq_.size(0); }

 private:
  double radius_floor_;
  torch::Tensor freq_;
};
TORCH_MODULE(RadialFeatures);

class ResidualBlockImpl : public torch::nn::Module {
 public:
  ResidualBlockImpl(int64_t width, int64_t hidden)
      : norm_(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc1_(register_module("fc1", torch::nn::Linear(width, hidden))),
        fc2_(register_module("fc2", torch::nn::Linear(hidden, width))) {}
  torch::Tensor forward(const torch::Tensor& h) { return h + fc2_->forward(torch::gelu(fc1_->forward(norm_->forward(h)))); }

 private:
  torch::nn::LayerNorm norm_;
  torch::nn::Linear fc1_, fc2_;
};
TORCH_MODULE(ResidualBlock);

class SpiralNet : public strobe::Model {
 public:
  SpiralNet(int64_t frequencies, int64_t width, int64_t depth, int64_t classes, double radius_floor) : strobe::Model("SpiralNet") {
    radial_ = register_module("radial", RadialFeatures(frequencies, radius_floor));
    stem_ = register_module("stem", torch::nn::Linear(radial_->out_features(), width));
    blocks_ = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < depth; ++i) blocks_->push_back(ResidualBlock(width, 2 * width));
    head_ = register_module("head", torch::nn::Linear(width, classes));
  }
  // The batch's "point" ([B, 2] float); input() casts it to the weights' dtype under bf16-master.
  torch::Tensor forward(const strobe::Batch& batch) override {
    auto h = stem_->forward(radial_->forward(input(batch.at("point"))));
    for (const auto& block : *blocks_) h = block->as<ResidualBlock>()->forward(h);
    return head_->forward(h);
  }
  std::string default_task() const override { return "example_focal"; }
  std::vector<std::string> batch_keys() const override { return {"point"}; }

 private:
  RadialFeatures radial_{nullptr};
  torch::nn::Linear stem_{nullptr}, head_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
};

// model: {name: spiral_net, frequencies, width, depth, num_classes, radius_floor}. Every key read is
// checked (range, type) and finish() refuses an unknown one: a typo is exit 2 naming the key.
std::shared_ptr<strobe::Model> make_spiral_net(strobe::config::Section& cfg) {
  const int64_t frequencies = cfg.get_int("frequencies", 8, 1, 256);
  const int64_t width = cfg.get_int("width", 64, 1);
  const int64_t depth = cfg.get_int("depth", 2, 0, 64);
  const int64_t classes = cfg.get_int("num_classes", 3, 2);
  const double radius_floor = cfg.get_double("radius_floor", 0.0, 0.0);
  cfg.finish();
  return std::make_shared<SpiralNet>(frequencies, width, depth, classes, radius_floor);
}
STROBE_REGISTER(strobe::model_registry(), "spiral_net", make_spiral_net);

}  // namespace strobe_example
