#include "models/resnet.h"

#include <torch/torch.h>

#include "models/flops.h"
#include "strobe/config/config.h"
#include "strobe/core/weight_names.h"
#include "strobe/ops/ops.h"
#include "models/fused_ops.h"
#include "models/layers.h"

namespace strobe::models {
namespace {

namespace nn = torch::nn;

nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(k / 2).bias(false));
}

// act(bn(x) [+ residual]) with act = ReLU or identity: one strobe::batch_norm_act in training when
// `mode` allows (header: fused_bn), else ATen's BatchNorm, add and ReLU.
torch::Tensor bn_act(nn::BatchNorm2dImpl& bn, const torch::Tensor& x, const std::optional<torch::Tensor>& residual,
                     bool relu, FusedOps mode) {
  const auto& o = bn.options;
  // (momentum None, a cumulative average, would need the batch count on the host: ATen keeps it)
  bool fused = mode != FusedOps::kOff && bn.is_training() && o.affine() && o.track_running_stats() && o.momentum();
  if (fused && mode == FusedOps::kAuto) {
    fused = ops::batch_norm_act_cuda_eligible(x, bn.weight, bn.bias, bn.running_mean, bn.running_var) &&
            (!residual || residual->is_contiguous(at::MemoryFormat::ChannelsLast));
  }
  if (fused) {
    {
      torch::NoGradGuard no_grad;
      bn.num_batches_tracked += 1;  // as BatchNormImpl::forward
    }
    return ops::batch_norm_act(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, residual, *o.momentum(),
                               o.eps(), relu);
  }
  torch::Tensor y = bn.forward(x);
  if (residual) y = y + *residual;
  return relu ? torch::relu(y) : y;
}

// A residual block; `expansion` 1 is torchvision's BasicBlock (two 3x3), 4 its Bottleneck (1x1, 3x3, 1x1).
class BlockImpl : public nn::Module {
 public:
  BlockImpl(int64_t in, int64_t planes, int64_t stride, int64_t expansion, FusedOps fused_bn)
      : expansion_(expansion), fused_bn_(fused_bn) {
    int64_t out = planes * expansion;
    if (expansion == 1) {
      conv1_ = register_module("conv1", conv(in, planes, 3, stride));
      bn1_ = register_module("bn1", nn::BatchNorm2d(planes));
      conv2_ = register_module("conv2", conv(planes, planes, 3, 1));
      bn2_ = register_module("bn2", nn::BatchNorm2d(planes));
    } else {
      conv1_ = register_module("conv1", conv(in, planes, 1, 1));
      bn1_ = register_module("bn1", nn::BatchNorm2d(planes));
      conv2_ = register_module("conv2", conv(planes, planes, 3, stride));
      bn2_ = register_module("bn2", nn::BatchNorm2d(planes));
      conv3_ = register_module("conv3", conv(planes, out, 1, 1));
      bn3_ = register_module("bn3", nn::BatchNorm2d(out));
    }
    if (stride != 1 || in != out) {
      downsample_ = register_module("downsample", nn::Sequential(conv(in, out, 1, stride), nn::BatchNorm2d(out)));
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor identity = x;
    if (downsample_) {
      identity = bn_act(*downsample_->ptr(1)->as<nn::BatchNorm2d>(), downsample_->ptr(0)->as<nn::Conv2d>()->forward(x),
                        std::nullopt, /*relu=*/false, fused_bn_);
    }
    torch::Tensor y = bn_act(*bn1_, conv1_(x), std::nullopt, true, fused_bn_);
    if (expansion_ == 1) return bn_act(*bn2_, conv2_(y), identity, true, fused_bn_);
    y = bn_act(*bn2_, conv2_(y), std::nullopt, true, fused_bn_);
    return bn_act(*bn3_, conv3_(y), identity, true, fused_bn_);
  }

 private:
  int64_t expansion_;
  FusedOps fused_bn_;
  nn::Conv2d conv1_{nullptr}, conv2_{nullptr}, conv3_{nullptr};
  nn::BatchNorm2d bn1_{nullptr}, bn2_{nullptr}, bn3_{nullptr};
  nn::Sequential downsample_{nullptr};
};
TORCH_MODULE(Block);

class ResNet : public Model {
 public:
  explicit ResNet(const ResNetOptions& o)
      : Model("ResNet"),
        o_(o),
        small_stem_(o.stem == "cifar"),
        memory_format_(o.memory_format),
        fused_bn_(parse_fused_ops(o.fused_bn)),
        custom_pool_(parse_fused_ops(o.custom_pool)) {
    const int64_t expansion = o.depth >= 50 ? 4 : 1;
    std::vector<int64_t> blocks;
    switch (o.depth) {
      case 18: blocks = {2, 2, 2, 2}; break;
      case 34: blocks = {3, 4, 6, 3}; break;
      case 50: blocks = {3, 4, 6, 3}; break;
      default: throw std::invalid_argument("resnet: depth must be 18, 34 or 50, got " + std::to_string(o.depth));
    }
    int64_t w = o.width;
    conv1_ = register_module("conv1", small_stem_ ? conv(o.in_channels, w, 3, 1) : conv(o.in_channels, w, 7, 2));
    bn1_ = register_module("bn1", nn::BatchNorm2d(w));
    int64_t in = w;
    for (int64_t s = 0; s < 4; ++s) {
      nn::Sequential layer;
      int64_t planes = w << s;
      for (int64_t b = 0; b < blocks[s]; ++b) {
        layer->push_back(Block(in, planes, (b == 0 && s > 0) ? 2 : 1, expansion, fused_bn_));
        in = planes * expansion;
      }
      layers_.push_back(register_module("layer" + std::to_string(s + 1), layer));
    }
    fc_ = register_module("fc", nn::Linear(in, o.num_classes));

    // torchvision's initialization: He (fan_out) for convolutions, BatchNorm at identity.
    for (auto& m : modules(/*include_self=*/false)) {
      if (auto* c = m->as<nn::Conv2d>()) {
        nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
      } else if (auto* bn = m->as<nn::BatchNorm2d>()) {
        nn::init::ones_(bn->weight);
        nn::init::zeros_(bn->bias);
      }
    }
  }

  void on_device(const torch::Device& device, Precision precision) override {
    // auto: NHWC where cuDNN's tensor-core kernels want it (bf16/fp16 on CUDA); fp32 stays NCHW.
    channels_last_ = memory_format_ == "channels_last" || (memory_format_ == "auto" && device.is_cuda() && precision != Precision::k32);
    if (!channels_last_) return;
    torch::NoGradGuard no_grad;
    // In place (set_data): the same parameter objects, now NHWC; the optimizer is built after this.
    for (auto& p : parameters())
      if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
  }

  torch::Tensor forward(const Batch& batch) override {
    torch::Tensor x = input(batch.at("image"));
    if (channels_last_ && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    x = bn_act(*bn1_, conv1_(x), std::nullopt, /*relu=*/true, fused_bn_);
    if (!small_stem_) {
      x = use_custom_pool(custom_pool_, x, "resnet") ? ops::max_pool2d(x, {3}, {2}, {1}) : torch::max_pool2d(x, 3, 2, 1);
    }
    int64_t index = 0;  // the block's number across the four stages
    for (auto& layer : layers_) {
      for (size_t b = 0; b < layer->size(); ++b) {
        auto block = layer->ptr<BlockImpl>(b);
        x = run_block(o_.activation_checkpointing, index++, *block, x, [block](const torch::Tensor& t) { return block->forward(t); });
      }
    }
    x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);
    return fc_(x);
  }

  std::string default_task() const override { return "classification"; }
  std::vector<std::string> batch_keys() const override { return {"image"}; }
  // Layer-wise lr decay by stage (timm's coarse ResNet grouping): the stem 0, layer1..layer4 1..4,
  // the classifier 5.
  int64_t num_layers() const override { return 6; }
  int64_t layer_of(const std::string& p) const override {
    if (p.rfind("conv1.", 0) == 0 || p.rfind("bn1.", 0) == 0) return 0;
    for (int s = 1; s <= 4; ++s)
      if (p.rfind("layer" + std::to_string(s) + ".", 0) == 0) return s;
    return 5;
  }
  // Every convolution at its output resolution for the batch's image size, and the classifier; the
  // stem convolution (the first layer) forward and weight gradient only (models/flops.h).
  double training_flops(const Batch& batch) const override {
    if (!batch.has("image") || batch.at("image").dim() != 4) return 0;
    int64_t h = batch.at("image").size(2), w = batch.at("image").size(3);
    const int64_t k = small_stem_ ? 3 : 7, s = small_stem_ ? 1 : 2;
    h = conv_out(h, k, s, k / 2), w = conv_out(w, k, s, k / 2);
    const double stem = static_cast<double>(o_.in_channels * k * k * o_.width * h * w);
    if (!small_stem_) h = conv_out(h, 3, 2, 1), w = conv_out(w, 3, 2, 1);
    const int64_t expansion = o_.depth >= 50 ? 4 : 1;
    const std::vector<int64_t> blocks = o_.depth == 18 ? std::vector<int64_t>{2, 2, 2, 2} : std::vector<int64_t>{3, 4, 6, 3};
    double macs = 0;  // multiply-adds of one image after the stem
    int64_t in = o_.width;
    for (size_t st = 0; st < 4; ++st) {
      const int64_t planes = o_.width << st, out = planes * expansion;
      for (int64_t b = 0; b < blocks[st]; ++b) {
        const int64_t stride = (b == 0 && st > 0) ? 2 : 1;
        const int64_t ho = conv_out(h, 3, stride, 1), wo = conv_out(w, 3, stride, 1);
        if (expansion == 1) {
          macs += static_cast<double>(in * 9 * planes * ho * wo + planes * 9 * planes * ho * wo);
        } else {
          macs += static_cast<double>(in * planes * h * w + planes * 9 * planes * ho * wo + planes * out * ho * wo);
        }
        if (stride != 1 || in != out) macs += static_cast<double>(in * out * ho * wo);
        in = out, h = ho, w = wo;
      }
    }
    macs += static_cast<double>(in * o_.num_classes);
    return static_cast<double>(batch_samples(batch)) * (3 * 2 * macs + 2 * 2 * stem);
  }

  const ResNetOptions& options() const { return o_; }

 private:
  ResNetOptions o_;
  bool small_stem_;
  std::string memory_format_;
  FusedOps fused_bn_;
  FusedOps custom_pool_;
  bool channels_last_ = false;
  nn::Conv2d conv1_{nullptr};
  nn::BatchNorm2d bn1_{nullptr};
  std::vector<nn::Sequential> layers_;
  nn::Linear fc_{nullptr};
};

std::shared_ptr<Model> make_resnet_from_config(config::Section& cfg) {
  ResNetOptions o;
  o.depth = cfg.get_int("depth", 18);
  if (o.depth != 18 && o.depth != 34 && o.depth != 50) cfg.fail("depth", "expected 18, 34 or 50");
  o.num_classes = cfg.get_int("num_classes", 1000, 1);
  o.in_channels = cfg.get_int("in_channels", 3, 1);
  o.width = cfg.get_int("width", 64, 1);
  o.stem = cfg.get_choice("stem", "imagenet", {"imagenet", "cifar"});
  o.memory_format = cfg.get_choice("memory_format", "auto", {"auto", "channels_last", "contiguous"});
  o.fused_bn = cfg.get_choice("fused_bn", "auto", {"auto", "true", "false"});
  o.custom_pool = cfg.get_choice("custom_pool", "auto", {"auto", "true", "false"});
  o.activation_checkpointing = ActivationCheckpointing::read(cfg);
  cfg.finish();
  return make_resnet(o);
}

// torchvision's resnet18/34/50 and timm's (the same state-dict names; in_chans in timm, conv1 replaced
// in torchvision, for in_channels other than 3): the names are Strobe's; what neither builds is refused.
NameMap resnet_names_as(const Model& model, const std::string& who) {
  const ResNetOptions& o = dynamic_cast<const ResNet&>(model).options();
  if (o.stem != "imagenet")
    throw WeightNamesError(fmt::format("{}'s ResNet has no stem '{}' (its stem is the 7x7 stride-2 conv and max-pool: "
                                       "stem: imagenet)",
                                       who, o.stem));
  if (o.width != 64)
    throw WeightNamesError(fmt::format("{}'s ResNet has 64 channels in its first stage, this one {} (width: 64)", who, o.width));
  return renamed(model, [](const std::string& n) { return n; });
}

}  // namespace

std::shared_ptr<Model> make_resnet(const ResNetOptions& options) { return std::make_shared<ResNet>(options); }

STROBE_REGISTER(model_registry(), "resnet", make_resnet_from_config);
STROBE_REGISTER(name_map_registry(), "resnet:torchvision",
                [](const Model& m) { return resnet_names_as(m, "torchvision"); });
STROBE_REGISTER(name_map_registry(), "resnet:timm", [](const Model& m) { return resnet_names_as(m, "timm"); });

}  // namespace strobe::models
