#include "models/face_detector.h"

#include <torch/torch.h>

#include "framework/config/config.h"

namespace strobe::models {
namespace {

namespace nn = torch::nn;

class FaceDetector : public Model {
 public:
  explicit FaceDetector(const FaceDetectorOptions& o) : Model("FaceDetector"), o_(o) {
    conv_layers_ = register_module("conv_layers", nn::Sequential());
    int64_t in = 1;
    for (int i = 0; i < 4; ++i) {
      conv_layers_->push_back(nn::Conv2d(nn::Conv2dOptions(in, in * 4, 3).padding(torch::kSame)));
      conv_layers_->push_back(nn::MaxPool2d(nn::MaxPool2dOptions(2).stride(2)));
      conv_layers_->push_back(nn::ReLU());
      in *= 4;
    }
    const int64_t side = o.image_size / 16;
    lin1_ = register_module("lin1", nn::Linear(256 * side * side, o.hidden_dim));
    lin2_ = register_module("lin2", nn::Linear(o.hidden_dim, o.max_boxes * 4));
  }

  torch::Tensor forward(const Batch& batch) override {
    auto x = batch.at("image");
    TORCH_CHECK(x.dim() == 4 && x.size(1) == 1 && x.size(2) == o_.image_size && x.size(3) == o_.image_size,
                "face_detector: expected image [B, 1, ", o_.image_size, ", ", o_.image_size, "], got ", x.sizes());
    x = input(x.is_floating_point() ? x : x.to(torch::kFloat32).div(255.0));
    x = conv_layers_->forward(x).flatten(1);
    return lin2_(torch::relu(lin1_(x))).view({-1, o_.max_boxes, 4});
  }

  std::string default_task() const override { return "detection"; }

 private:
  FaceDetectorOptions o_;
  nn::Sequential conv_layers_{nullptr};
  nn::Linear lin1_{nullptr}, lin2_{nullptr};
};

std::shared_ptr<Model> make_from_config(config::Section& cfg) {
  FaceDetectorOptions o;
  o.image_size = cfg.get_int("image_size", 256, 16);
  if (o.image_size % 16 != 0) cfg.fail("image_size", "must be a multiple of 16 (four 2x2 max-pools)");
  o.max_boxes = cfg.get_int("max_boxes", 256, 1);
  o.hidden_dim = cfg.get_int("hidden_dim", 256 * 64, 1);
  cfg.finish();
  return make_face_detector(o);
}

}  // namespace

std::shared_ptr<Model> make_face_detector(const FaceDetectorOptions& options) {
  return std::make_shared<FaceDetector>(options);
}

STROBE_REGISTER(model_registry(), "face_detector", make_from_config);

}  // namespace strobe::models
