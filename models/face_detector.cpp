#include "models/face_detector.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "models/flops.h"
#include "strobe/config/config.h"
#include "strobe/ops/ops.h"
#include "models/fused_ops.h"

namespace strobe::models {
namespace {

namespace nn = torch::nn;

class FaceDetector : public Model {
 public:
  explicit FaceDetector(const FaceDetectorOptions& o)
      : Model("FaceDetector"), o_(o), custom_pool_(parse_fused_ops(o.custom_pool)) {
    conv_layers_ = register_module("conv_layers", nn::Sequential());
    int64_t in = 1;
    for (int i = 0; i < 4; ++i) {
      nn::Conv2d conv(nn::Conv2dOptions(in, in * 4, 3).padding(torch::kSame));
      convs_.push_back(conv);
      conv_layers_->push_back(conv);
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
    x = conv_stack(input(x)).flatten(1);  // input(): bf16-master casts floating images (uint8 stays)
    return lin2_(torch::relu(lin1_(x))).view({-1, o_.max_boxes, 4});
  }

  std::string default_task() const override { return "detection"; }
  std::vector<std::string> batch_keys() const override { return {"image"}; }
  // The four 3x3 convolutions at their resolutions (the first forward and weight gradient only) and
  // the two Linear layers, per image (models/flops.h).
  double training_flops(const Batch& batch) const override {
    double first = 0, rest = 0;
    int64_t side = o_.image_size;
    for (const auto& conv : convs_) {
      const double macs = static_cast<double>(conv->weight.numel() * side * side);
      (first == 0 ? first : rest) += macs;
      side /= 2;
    }
    rest += static_cast<double>(lin1_->weight.numel() + lin2_->weight.numel());
    return static_cast<double>(batch_samples(batch)) * (3 * 2 * rest + 2 * 2 * first);
  }

 private:
  bool use_fused(const torch::Tensor& x) const {
    if (o_.fused_conv == FusedConv::kOn) return true;
    return o_.fused_conv == FusedConv::kAuto && x.is_cuda() && ops::built_with_cuda();
  }

  // The first fused_conv_stages stages through strobe::conv3x3_maxpool_relu (same parameters, so
  // checkpoints are interchangeable), the rest through the ATen modules. uint8 images go to the
  // fused op as they are (scaled by 1/255 inside the kernel).
  torch::Tensor conv_stack(torch::Tensor x) {
    int64_t first = 0;
    if (use_fused(x) && o_.fused_conv_stages > 0) {
      const auto dev = x.device().type();
      std::optional<at::ScalarType> out;
      // The dtype the convolutions would emit: the autocast dtype under autocast, else the
      // weights' (fp32, or bf16 when the parameters themselves are bf16).
      if (at::autocast::is_autocast_enabled(dev)) out = at::autocast::get_autocast_dtype(dev);
      double scale = x.is_floating_point() ? 1.0 : 1.0 / 255.0;
      for (; first < o_.fused_conv_stages; ++first) {
        const auto& conv = convs_[static_cast<size_t>(first)];
        x = ops::conv3x3_maxpool_relu(x, conv->weight, conv->bias, scale,
                                      out.value_or(conv->weight.scalar_type()));
        scale = 1.0;
      }
    }
    if (!x.is_floating_point()) x = input(x.to(torch::kFloat32).div(255.0));
    for (size_t i = static_cast<size_t>(first); i < convs_.size(); ++i) {
      const torch::Tensor z = convs_[i]->forward(x);  // = conv_layers_[3i..3i+2]
      x = torch::relu(use_custom_pool(custom_pool_, z, "face_detector") ? ops::max_pool2d(z, {2}, {2}, {0})
                                                                         : torch::max_pool2d(z, 2, 2));
    }
    return x;
  }

  std::vector<nn::Conv2d> convs_;
  FaceDetectorOptions o_;
  FusedOps custom_pool_;
  nn::Sequential conv_layers_{nullptr};
  nn::Linear lin1_{nullptr}, lin2_{nullptr};
};

std::shared_ptr<Model> make_face_detector_from_config(config::Section& cfg) {
  FaceDetectorOptions o;
  o.image_size = cfg.get_int("image_size", 256, 16);
  if (o.image_size % 16 != 0) cfg.fail("image_size", "must be a multiple of 16 (four 2x2 max-pools)");
  o.max_boxes = cfg.get_int("max_boxes", 256, 1);
  o.hidden_dim = cfg.get_int("hidden_dim", 256 * 64, 1);
  const std::string fused = cfg.get_choice("fused_conv", "auto", {"auto", "true", "false"});
  o.fused_conv = fused == "true" ? FusedConv::kOn : fused == "false" ? FusedConv::kOff : FusedConv::kAuto;
  o.fused_conv_stages = cfg.get_int("fused_conv_stages", 2, 0, 4);
  o.custom_pool = cfg.get_choice("custom_pool", "auto", {"auto", "true", "false"});
  cfg.finish();
  return make_face_detector(o);
}

}  // namespace

std::shared_ptr<Model> make_face_detector(const FaceDetectorOptions& options) {
  return std::make_shared<FaceDetector>(options);
}

STROBE_REGISTER(model_registry(), "face_detector", make_face_detector_from_config);

}  // namespace strobe::models
