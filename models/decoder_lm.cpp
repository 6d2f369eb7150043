#include "models/decoder_lm.h"

#include <torch/torch.h>

#include "models/flops.h"
#include "strobe/config/config.h"
#include "strobe/ops/ops.h"
#include "models/layers.h"

namespace strobe::models {
namespace {

namespace nn = torch::nn;

// nn.LayerNorm(dim, bias=False): a learned scale, no shift (libtorch's LayerNorm has no such option).
class LayerNormNoBiasImpl : public nn::Module {
 public:
  explicit LayerNormNoBiasImpl(int64_t dim) : dim_(dim) { weight = register_parameter("weight", torch::ones({dim})); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::layer_norm(x, {dim_}, weight, {}, 1e-5); }  // eps: DecoderBlockImpl::kEps
  torch::Tensor weight;

 private:
  int64_t dim_;
};
TORCH_MODULE(LayerNormNoBias);

class DecoderBlockImpl : public nn::Module {
 public:
  DecoderBlockImpl(int64_t dim, int64_t heads, int64_t hidden, AttentionBackend backend, bool gelu_tanh, FusedOps mode)
      : heads_(heads), backend_(backend), gelu_tanh_(gelu_tanh), mode_(mode) {
    norm1 = register_module("norm1", LayerNormNoBias(dim));
    qkv = register_module("qkv", nn::Linear(dim, 3 * dim));
    proj = register_module("proj", nn::Linear(dim, dim));
    norm2 = register_module("norm2", LayerNormNoBias(dim));
    fc1 = register_module("fc1", nn::Linear(dim, hidden));
    fc2 = register_module("fc2", nn::Linear(hidden, dim));
  }

  torch::Tensor forward(torch::Tensor x, const TokenLayout& in) {
    x = x + linear(proj, attend(norm1(x), in));
    return x + transformer_mlp(norm2(x), fc1, fc2, gelu_tanh_, false, FusedOps::kOff);
  }

  // The fused path (see vit.cpp): the residual stream is res + pending between blocks, and every
  // residual add runs inside strobe::add_layer_norm with the LayerNorm after it.
  std::pair<torch::Tensor, torch::Tensor> forward_fused(const torch::Tensor& res, const torch::Tensor& pending,
                                                        const TokenLayout& in) {
    torch::Tensor x, h;
    if (pending.defined()) {
      std::tie(x, h) = residual_layer_norm(res, pending, norm1->weight, {}, kEps);
    } else {
      x = res;
      h = ops::layer_norm(res, norm1->weight, {}, kEps);
    }
    auto [x2, h2] = residual_layer_norm(x, linear(proj, attend(h, in)), norm2->weight, {}, kEps);
    return {x2, transformer_mlp(h2, fc1, fc2, gelu_tanh_, true, mode_)};
  }

  LayerNormNoBias norm1{nullptr}, norm2{nullptr};
  nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};

 private:
  static constexpr double kEps = 1e-5;  // LayerNormNoBias's

  // Attention over the normalised h ([T, C] packed or [B, S, C]), before proj.
  torch::Tensor attend(const torch::Tensor& x, const TokenLayout& in) {
    const int64_t c = x.size(-1), hd = c / heads_;
    auto qkv_out = linear(qkv, x);
    torch::Tensor a;
    if (in.cu_seqlens.defined()) {  // x: [T, C]
      auto parts = qkv_out.view({x.size(0), 3, heads_, hd}).unbind(1);
      a = attention_varlen(parts[0], parts[1], parts[2], in.cu_seqlens, in.max_seqlen, /*causal=*/true, backend_)
              .reshape({x.size(0), c});
    } else {  // x: [B, S, C]
      const int64_t b = x.size(0), s = x.size(1);
      auto parts = qkv_out.view({b, s, 3, heads_, hd}).unbind(2);  // [B, S, H, D] views
      a = attention(parts[0], parts[1], parts[2], /*causal=*/true, in.key_padding_mask, backend_).reshape({b, s, c});
    }
    return a;
  }

  int64_t heads_;
  AttentionBackend backend_;
  bool gelu_tanh_;
  FusedOps mode_;
};
TORCH_MODULE(DecoderBlock);

class DecoderLM : public Model {
 public:
  explicit DecoderLM(const DecoderLMOptions& o) : Model("DecoderLM"), o_(o) {
    embedding_ = register_module("embedding", nn::Embedding(o.vocab_size, o.embed_dim));
    positional_embedding_ = register_module("positional_embedding", nn::Embedding(o.max_seq_len, o.embed_dim));
    blocks_ = register_module("blocks", nn::ModuleList());
    const auto hidden = static_cast<int64_t>(o.embed_dim * o.mlp_ratio);
    for (int64_t i = 0; i < o.depth; ++i) blocks_->push_back(DecoderBlock(o.embed_dim, o.num_heads, hidden, o.attention, o.gelu == "tanh", o.fused_ops));
    output_ = register_module("output", nn::Linear(o.embed_dim, o.vocab_size));
  }

  torch::Tensor forward(const Batch& batch) override {
    const auto head = forward_head_input(batch);
    return run_in_unit(*output_, head.hidden, [this](const torch::Tensor& h) { return linear(output_, h); });
  }

  int64_t head_input_vocab() const override { return o_.vocab_size; }
  HeadInput forward_head_input(const Batch& batch) override {
    const auto& tokens = batch.at("tokens");
    const TokenLayout in = token_layout(batch, "decoder_lm");  // padded (mask only if not right-padded) or packed
    auto x = embedding_(tokens) + positional_embedding_(in.positions);
    if (use_fused_ops(o_.fused_ops, x, "decoder_lm")) {
      torch::Tensor pending;
      for (size_t i = 0; i < blocks_->size(); ++i) {
        auto block = blocks_->ptr<DecoderBlockImpl>(i);
        std::tie(x, pending) = run_block(o_.activation_checkpointing, static_cast<int64_t>(i), *block, x, pending,
                                         [block, in](const torch::Tensor& r, const torch::Tensor& p) { return block->forward_fused(r, p, in); });
      }
      x = x + pending;  // no final LayerNorm (the seed's model): a plain add
    } else {
      for (size_t i = 0; i < blocks_->size(); ++i) {
        auto block = blocks_->ptr<DecoderBlockImpl>(i);
        x = run_block(o_.activation_checkpointing, static_cast<int64_t>(i), *block, x,
                      [block, in](const torch::Tensor& t) { return block->forward(t, in); });
      }
    }
    return {x, output_->weight, output_->bias, output_.get()};
  }

  std::string default_task() const override { return "language_modeling"; }
  std::vector<std::string> batch_keys() const override { return {"tokens"}; }
  // Layer-wise lr decay: both embeddings 0, block i layer i + 1, the output head depth + 1.
  int64_t num_layers() const override { return o_.depth + 2; }
  // The blocks' qkv, proj, fc1 and fc2, not the embeddings or the head.
  std::vector<std::string> fp8_layers() const override { return {"blocks.*"}; }
  // The output head a unit of its own; the embeddings stay in the kept unit.
  std::vector<std::string> fsdp_units() const override { return {"blocks.*", "output"}; }
  int64_t layer_of(const std::string& p) const override {
    if (p.rfind("embedding.", 0) == 0 || p.rfind("positional_embedding.", 0) == 0) return 0;
    if (const int64_t i = list_index(p, "blocks"); i >= 0) return i + 1;
    return o_.depth + 1;
  }
  // PaLM's count (models/flops.h).
  double training_flops(const Batch& batch) const override {
    if (matmul_params_ < 0) matmul_params_ = linear_weight_params(*this);
    return decoder_training_flops(batch, matmul_params_, o_.depth, o_.embed_dim);
  }

  void on_device(const torch::Device& device, Precision precision) override {
    check_attention_on_device(o_.attention, o_.embed_dim / o_.num_heads, device, precision);
  }

 private:
  DecoderLMOptions o_;
  mutable double matmul_params_ = -1;  // training_flops: counted on first use
  nn::Embedding embedding_{nullptr}, positional_embedding_{nullptr};
  nn::ModuleList blocks_{nullptr};
  nn::Linear output_{nullptr};
};

std::shared_ptr<Model> make_decoder_lm_from_config(config::Section& cfg) {
  DecoderLMOptions o;
  o.vocab_size = cfg.get_int("vocab_size", 1024, 1);
  o.max_seq_len = cfg.get_int("max_seq_len", 1024, 1);
  o.embed_dim = cfg.get_int("embed_dim", 1024, 1);
  o.depth = cfg.get_int("depth", 24, 1);
  o.num_heads = cfg.get_int("num_heads", 16, 1);
  if (o.embed_dim % o.num_heads != 0) cfg.fail("num_heads", "must divide embed_dim (" + std::to_string(o.embed_dim) + ")");
  o.mlp_ratio = cfg.get_double("mlp_ratio", 4.0, 1e-3);
  o.attention = read_attention_backend(cfg);
  o.fused_ops = parse_fused_ops(cfg.get_choice("fused_ops", "auto", {"auto", "true", "false"}));
  o.gelu = cfg.get_choice("gelu", "erf", {"erf", "tanh"});
  o.activation_checkpointing = ActivationCheckpointing::read(cfg);
  cfg.finish();
  return make_decoder_lm(o);
}

}  // namespace

std::shared_ptr<Model> make_decoder_lm(const DecoderLMOptions& options) { return std::make_shared<DecoderLM>(options); }

STROBE_REGISTER(model_registry(), "decoder_lm", make_decoder_lm_from_config);

}  // namespace strobe::models
