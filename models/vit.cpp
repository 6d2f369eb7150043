#include "models/vit.h"

#include <optional>
#include <utility>

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

void init_trunc_normal(torch::Tensor& w, double std) {
  torch::NoGradGuard guard;
  w.normal_(0.0, std).clamp_(-2 * std, 2 * std);
}

class EncoderBlockImpl : public nn::Module {
 public:
  EncoderBlockImpl(int64_t dim, int64_t heads, int64_t hidden, bool qkv_bias, AttentionBackend backend, bool gelu_tanh,
                   FusedOps mode)
      : heads_(heads), backend_(backend), gelu_tanh_(gelu_tanh), mode_(mode) {
    norm1 = register_module("norm1", nn::LayerNorm(nn::LayerNormOptions({dim}).eps(1e-6)));
    qkv = register_module("qkv", nn::Linear(nn::LinearOptions(dim, 3 * dim).bias(qkv_bias)));
    proj = register_module("proj", nn::Linear(dim, dim));
    norm2 = register_module("norm2", nn::LayerNorm(nn::LayerNormOptions({dim}).eps(1e-6)));
    fc1 = register_module("fc1", nn::Linear(dim, hidden));
    fc2 = register_module("fc2", nn::Linear(hidden, dim));
  }

  torch::Tensor forward(torch::Tensor x) {
    x = x + linear(proj, attend(norm1(x)));
    return x + transformer_mlp(norm2(x), fc1, fc2, gelu_tanh_, false, FusedOps::kOff);
  }

  // The same block on the fused path: the residual stream arrives as res + pending (pending = the
  // previous block's MLP output, undefined before the first block) and leaves the same way, so
  // every residual add runs inside strobe::add_layer_norm with the LayerNorm that follows it.
  std::pair<torch::Tensor, torch::Tensor> forward_fused(const torch::Tensor& res, const torch::Tensor& pending) {
    // trainer.fp8: the norms after a residual add give the amax of their outputs to qkv and fc1 when
    // those run in float8 (the first block's plain LayerNorm leaves it to the cast).
    std::optional<torch::Tensor> h_amax, h2_amax;
    torch::Tensor x, h;
    if (pending.defined()) {
      std::tie(x, h) = residual_layer_norm(res, pending, norm1->weight, norm1->bias, norm1->options.eps(),
                                           fp8_marked(*qkv) ? &h_amax : nullptr);
    } else {
      x = res;
      h = ops::layer_norm(res, norm1->weight, norm1->bias, norm1->options.eps());
    }
    auto [x2, h2] = residual_layer_norm(x, linear(proj, attend(h, h_amax)), norm2->weight, norm2->bias,
                                        norm2->options.eps(), fp8_marked(*fc1) ? &h2_amax : nullptr);
    return {x2, transformer_mlp(h2, fc1, fc2, gelu_tanh_, true, mode_, h2_amax)};
  }

  nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};

 private:
  // Attention over the normalised h [B, S, C], before proj.
  torch::Tensor attend(const torch::Tensor& h, const std::optional<torch::Tensor>& h_amax = std::nullopt) {
    const int64_t b = h.size(0), s = h.size(1), c = h.size(2);
    // q, k, v are [B, S, H, D] views of the fused projection: no permute copy around attention.
    auto qkv_out = linear(qkv, h, h_amax).view({b, s, 3, heads_, c / heads_}).unbind(2);
    return attention(qkv_out[0], qkv_out[1], qkv_out[2], /*causal=*/false, std::nullopt, backend_).reshape({b, s, c});
  }

  int64_t heads_;
  AttentionBackend backend_;
  bool gelu_tanh_;
  FusedOps mode_;
};
TORCH_MODULE(EncoderBlock);

class ViT : public Model {
 public:
  explicit ViT(const ViTOptions& o) : Model("ViT"), o_(o) {
    const int64_t grid = o.img_size / o.patch_size, d = o.embed_dim;
    patch_embed_ = register_module(
        "patch_embed", nn::Conv2d(nn::Conv2dOptions(o.in_channels, d, o.patch_size).stride(o.patch_size)));
    if (o.class_token) cls_token_ = register_parameter("cls_token", torch::zeros({1, 1, d}));
    pos_embed_ = register_parameter("pos_embed", torch::zeros({1, grid * grid + (o.class_token ? 1 : 0), d}));
    blocks_ = register_module("blocks", nn::ModuleList());
    const auto hidden = static_cast<int64_t>(d * o.mlp_ratio);
    for (int64_t i = 0; i < o.depth; ++i) blocks_->push_back(EncoderBlock(d, o.num_heads, hidden, o.qkv_bias, o.attention, o.gelu == "tanh", o.fused_ops));
    norm_ = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({d}).eps(1e-6)));
    head_ = register_module("head", nn::Linear(d, o.num_classes));

    // timm's initialization: truncated normal(0.02) for linear weights and positions, zero biases.
    init_trunc_normal(pos_embed_, 0.02);
    if (o.class_token) {
      torch::NoGradGuard guard;
      cls_token_.normal_(0.0, 1e-6);
    }
    for (auto& m : modules(false)) {
      if (auto* lin = m->as<nn::Linear>()) {
        init_trunc_normal(lin->weight, 0.02);
        if (lin->bias.defined()) nn::init::zeros_(lin->bias);
      }
    }
  }

  torch::Tensor forward(const Batch& batch) override {
    const auto& image = batch.at("image");
    TORCH_CHECK(image.dim() == 4 && image.size(2) == o_.img_size && image.size(3) == o_.img_size,
                "vit: expected image [B, ", o_.in_channels, ", ", o_.img_size, ", ", o_.img_size, "], got ", image.sizes());
    // [B, N, D] made contiguous once: the transposed view would carry its [B, D, N] layout through
    // every residual add (TensorIterator keeps the first input's layout), making each add and each
    // LayerNorm input a strided pass (38 ms of a 151 ms ViT-L step on an H200, bench/e2e/profile_gpu.sh).
    auto x = patch_embed_(input(image)).flatten(2).transpose(1, 2).contiguous();
    if (o_.class_token) x = torch::cat({cls_token_.expand({x.size(0), 1, x.size(2)}).to(x.scalar_type()), x}, 1);
    x = x + pos_embed_;
    if (use_fused_ops(o_.fused_ops, x, "vit")) {
      torch::Tensor pending;
      for (size_t i = 0; i < blocks_->size(); ++i) {
        auto block = blocks_->ptr<EncoderBlockImpl>(i);
        std::tie(x, pending) = run_block(o_.activation_checkpointing, static_cast<int64_t>(i), *block, x, pending,
                                         [block](const torch::Tensor& r, const torch::Tensor& p) { return block->forward_fused(r, p); });
      }
      const double eps = norm_->options.eps();
      if (o_.global_pool == "token") {
        // The last MLP residual fused with the final LayerNorm (over every token, as norm_(x)).
        x = std::get<1>(residual_layer_norm(x, pending, norm_->weight, norm_->bias, eps)).select(1, 0);
      } else {
        x = ops::layer_norm((x + pending).mean(1), norm_->weight, norm_->bias, eps);
      }
      return head_(x);
    }
    for (size_t i = 0; i < blocks_->size(); ++i) {
      auto block = blocks_->ptr<EncoderBlockImpl>(i);
      x = run_block(o_.activation_checkpointing, static_cast<int64_t>(i), *block, x,
                    [block](const torch::Tensor& t) { return block->forward(t); });
    }
    x = o_.global_pool == "token" ? norm_(x).select(1, 0) : norm_(x.mean(1));
    return head_(x);
  }

  std::string default_task() const override { return "classification"; }
  std::vector<std::string> batch_keys() const override { return {"image"}; }
  std::vector<std::string> no_weight_decay() const override { return {"pos_embed", "cls_token"}; }
  // timm's ViT order (group_matcher(coarse=False) through param_groups_layer_decay): the embeddings
  // 0, block i layer i + 1, the head depth + 1; the final norm is the last block's layer under token
  // pooling (timm's `norm`) and the head's under avg (timm's `fc_norm`).
  int64_t num_layers() const override { return o_.depth + 2; }
  // The blocks' qkv, proj, fc1 and fc2, not the patch embedding or the head.
  std::vector<std::string> fp8_layers() const override { return {"blocks.*"}; }
  std::vector<std::string> fsdp_units() const override { return {"blocks.*"}; }
  int64_t layer_of(const std::string& p) const override {
    if (p == "cls_token" || p == "pos_embed" || p.rfind("patch_embed.", 0) == 0) return 0;
    if (const int64_t i = list_index(p, "blocks"); i >= 0) return i + 1;
    if (p.rfind("norm.", 0) == 0) return o_.global_pool == "token" ? o_.depth : o_.depth + 1;
    return o_.depth + 1;
  }
  // Per image: the blocks' Linear weights and attention over every token, the head once, the patch
  // embedding (the first layer: forward and weight gradient only) over every patch (models/flops.h).
  double training_flops(const Batch& batch) const override {
    const double grid = static_cast<double>(o_.img_size / o_.patch_size), d = static_cast<double>(o_.embed_dim);
    const double tokens = grid * grid + (o_.class_token ? 1 : 0);
    const double head = static_cast<double>(head_->weight.numel());
    if (linear_weights_ < 0) linear_weights_ = linear_weight_params(*this);  // counted once: this runs every batch
    const double blocks = linear_weights_ - head;
    const double patch = static_cast<double>(patch_embed_->weight.numel()) * grid * grid;
    const double forward = 2 * blocks * tokens + 2 * head + 4 * static_cast<double>(o_.depth) * tokens * tokens * d;
    return static_cast<double>(batch_samples(batch)) * (3 * forward + 2 * 2 * patch);
  }

  void on_device(const torch::Device& device, Precision precision) override {
    check_attention_on_device(o_.attention, o_.embed_dim / o_.num_heads, device, precision);
  }
  const ViTOptions& options() const { return o_; }

 private:
  ViTOptions o_;
  mutable double linear_weights_ = -1;  // training_flops: counted on first use
  nn::Conv2d patch_embed_{nullptr};
  torch::Tensor cls_token_, pos_embed_;
  nn::ModuleList blocks_{nullptr};
  nn::LayerNorm norm_{nullptr};
  nn::Linear head_{nullptr};
};

std::shared_ptr<Model> make_vit_from_config(config::Section& cfg) {
  ViTOptions o;
  o.img_size = cfg.get_int("img_size", 224, 1);
  o.patch_size = cfg.get_int("patch_size", 16, 1);
  if (o.img_size % o.patch_size != 0) cfg.fail("patch_size", "must divide img_size (" + std::to_string(o.img_size) + ")");
  o.in_channels = cfg.get_int("in_channels", 3, 1);
  o.num_classes = cfg.get_int("num_classes", 1000, 1);
  o.embed_dim = cfg.get_int("embed_dim", 768, 1);
  o.depth = cfg.get_int("depth", 12, 1);
  o.num_heads = cfg.get_int("num_heads", 12, 1);
  if (o.embed_dim % o.num_heads != 0) cfg.fail("num_heads", "must divide embed_dim (" + std::to_string(o.embed_dim) + ")");
  o.mlp_ratio = cfg.get_double("mlp_ratio", 4.0, 1e-3);
  o.class_token = cfg.get_bool("class_token", true);
  o.global_pool = cfg.get_choice("global_pool", o.class_token ? "token" : "avg", {"token", "avg"});
  if (o.global_pool == "token" && !o.class_token) cfg.fail("global_pool", "token pooling needs class_token: true");
  o.qkv_bias = cfg.get_bool("qkv_bias", true);
  o.attention = read_attention_backend(cfg);
  o.fused_ops = parse_fused_ops(cfg.get_choice("fused_ops", "auto", {"auto", "true", "false"}));
  o.gelu = cfg.get_choice("gelu", "erf", {"erf", "tanh"});
  o.activation_checkpointing = ActivationCheckpointing::read(cfg);
  cfg.finish();
  return make_vit(o);
}

// blocks.<i>.<rest> -> {i, rest}; nullopt for names outside the blocks.
std::optional<std::pair<std::string, std::string>> block_part(const std::string& name) {
  const std::string prefix = "blocks.";
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos || dot + 1 == name.size()) return std::nullopt;
  std::string index = name.substr(prefix.size(), dot - prefix.size());
  if (!config::is_digits(index)) return std::nullopt;
  return std::make_pair(index, name.substr(dot + 1));
}

std::string replace_prefix(const std::string& name, const std::string& from, const std::string& to) {
  return name.rfind(from, 0) == 0 ? to + name.substr(from.size()) : name;
}

// timm's VisionTransformer (timm.models.vision_transformer): the same tensors and layouts (fused qkv
// in q, k, v order, cls token first, pos_embed over every token), renamed; average pooling
// normalises after the mean as timm's fc_norm (its `norm` is then an Identity).
NameMap vit_timm_names(const Model& model) {
  const ViTOptions& o = dynamic_cast<const ViT&>(model).options();
  if (o.class_token && o.global_pool == "avg")
    throw WeightNamesError(
        "timm's VisionTransformer with a class token and global_pool 'avg' averages the patch tokens "
        "alone, Strobe's vit averages the class token too: the logits would differ (use class_token: false "
        "with global_pool: avg, or global_pool: token)");
  const bool avg = o.global_pool == "avg";
  return renamed(model, [avg](const std::string& n) {
    if (auto b = block_part(n)) {
      const auto& [i, rest] = *b;
      for (const char* attn : {"qkv.", "proj."})
        if (rest.rfind(attn, 0) == 0) return "blocks." + i + ".attn." + rest;
      for (const char* mlp : {"fc1.", "fc2."})
        if (rest.rfind(mlp, 0) == 0) return "blocks." + i + ".mlp." + rest;
      return n;  // norm1, norm2
    }
    if (n.rfind("patch_embed.", 0) == 0) return replace_prefix(n, "patch_embed.", "patch_embed.proj.");
    if (avg && n.rfind("norm.", 0) == 0) return replace_prefix(n, "norm.", "fc_norm.");
    return n;  // cls_token, pos_embed, norm, head
  });
}

// torchvision.models.VisionTransformer (vit_b_16, vit_l_16, ...): class token, token pooling and
// biased qkv only (nn.MultiheadAttention's in_proj is the fused qkv in q, k, v order).
NameMap vit_torchvision_names(const Model& model) {
  const ViTOptions& o = dynamic_cast<const ViT&>(model).options();
  if (!o.class_token || o.global_pool != "token")
    throw WeightNamesError("torchvision's VisionTransformer classifies from a class token: it has no "
                           "global_pool 'avg' (use class_token: true, global_pool: token)");
  if (!o.qkv_bias) throw WeightNamesError("torchvision's VisionTransformer has qkv biases (use qkv_bias: true)");
  return renamed(model, [](const std::string& n) -> std::string {
    if (auto b = block_part(n)) {
      const auto& [i, rest] = *b;
      const std::string layer = "encoder.layers.encoder_layer_" + i + ".";
      static const std::vector<std::pair<std::string, std::string>> parts = {
          {"norm1.", "ln_1."},
          {"norm2.", "ln_2."},
          {"qkv.weight", "self_attention.in_proj_weight"},
          {"qkv.bias", "self_attention.in_proj_bias"},
          {"proj.", "self_attention.out_proj."},
          {"fc1.", "mlp.0."},
          {"fc2.", "mlp.3."}};
      for (const auto& [from, to] : parts)
        if (rest.rfind(from, 0) == 0) return layer + to + rest.substr(from.size());
      return layer + rest;
    }
    if (n == "cls_token") return "class_token";
    if (n == "pos_embed") return "encoder.pos_embedding";
    for (const auto& [from, to] : {std::pair<std::string, std::string>{"patch_embed.", "conv_proj."},
                                   {"norm.", "encoder.ln."},
                                   {"head.", "heads.head."}})
      if (n.rfind(from, 0) == 0) return to + n.substr(from.size());
    return n;
  });
}

}  // namespace

std::shared_ptr<Model> make_vit(const ViTOptions& options) { return std::make_shared<ViT>(options); }

STROBE_REGISTER(model_registry(), "vit", make_vit_from_config);
STROBE_REGISTER(name_map_registry(), "vit:timm", vit_timm_names);
STROBE_REGISTER(name_map_registry(), "vit:torchvision", vit_torchvision_names);

}  // namespace strobe::models
