#include "models/llama.h"

#include <torch/torch.h>

#include <fmt/format.h>

#include "framework/config/config.h"

namespace strobe::models {
namespace {

namespace nn = torch::nn;


class RMSNormImpl : public nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps) : eps_(eps) { weight = register_parameter("weight", torch::ones({dim})); }
  torch::Tensor forward(const torch::Tensor& x) { return llama_ops::rms_norm(x, weight, eps_); }
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

nn::Linear bias_free(int64_t in, int64_t out) { return nn::Linear(nn::LinearOptions(in, out).bias(false)); }

// Where attention gets its structure from: a padded batch (optional key mask) or a packed one.
struct Structure {
  std::optional<torch::Tensor> key_padding_mask;
  torch::Tensor cu_seqlens;  // defined: packed
  int64_t max_seqlen = 0;
};

class LlamaAttentionImpl : public nn::Module {
 public:
  LlamaAttentionImpl(int64_t dim, int64_t heads, int64_t kv_heads, AttentionBackend backend)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(dim / heads), backend_(backend) {
    q_proj = register_module("q_proj", bias_free(dim, heads * head_dim_));
    k_proj = register_module("k_proj", bias_free(dim, kv_heads * head_dim_));
    v_proj = register_module("v_proj", bias_free(dim, kv_heads * head_dim_));
    o_proj = register_module("o_proj", bias_free(heads * head_dim_, dim));
  }

  // x [B, S, C] or packed [T, C]; cos/sin [B, S, D] or [T, D].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const Structure& in) {
    auto lead = x.sizes().vec();
    lead.pop_back();
    auto heads = [&](const torch::Tensor& t, int64_t n) {
      auto shape = lead;
      shape.push_back(n);
      shape.push_back(head_dim_);
      return t.view(shape);
    };
    auto q = llama_ops::apply_rotary(heads(at::linear(x, q_proj->weight), heads_), cos, sin);
    auto k = llama_ops::apply_rotary(heads(at::linear(x, k_proj->weight), kv_heads_), cos, sin);
    auto v = heads(at::linear(x, v_proj->weight), kv_heads_);
    k = llama_ops::repeat_kv(k, heads_ / kv_heads_);
    v = llama_ops::repeat_kv(v, heads_ / kv_heads_);
    torch::Tensor a = in.cu_seqlens.defined()
                          ? attention_varlen(q, k, v, in.cu_seqlens, in.max_seqlen, /*causal=*/true, backend_)
                          : attention(q, k, v, /*causal=*/true, in.key_padding_mask, backend_);
    auto out_shape = lead;
    out_shape.push_back(heads_ * head_dim_);
    return at::linear(a.reshape(out_shape), o_proj->weight);
  }

  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  int64_t heads_, kv_heads_, head_dim_;
  AttentionBackend backend_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public nn::Module {
 public:
  LlamaMLPImpl(int64_t dim, int64_t hidden) {
    gate_proj = register_module("gate_proj", bias_free(dim, hidden));
    up_proj = register_module("up_proj", bias_free(dim, hidden));
    down_proj = register_module("down_proj", bias_free(hidden, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) { return llama_ops::swiglu(x, gate_proj->weight, up_proj->weight, down_proj->weight); }
  nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

class LlamaDecoderLayerImpl : public nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const LlamaOptions& o, int64_t ffn) {
    input_layernorm = register_module("input_layernorm", RMSNorm(o.embed_dim, o.norm_eps));
    self_attn = register_module("self_attn", LlamaAttention(o.embed_dim, o.num_heads, o.num_kv_heads, o.attention));
    post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(o.embed_dim, o.norm_eps));
    mlp = register_module("mlp", LlamaMLP(o.embed_dim, ffn));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, const Structure& in) {
    x = x + self_attn->forward(input_layernorm(x), cos, sin, in);
    return x + mlp(post_attention_layernorm(x));
  }
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

class Llama : public Model {
 public:
  explicit Llama(const LlamaOptions& o) : Model("Llama"), o_(o) {
    const int64_t ffn = o.ffn_dim > 0 ? o.ffn_dim : llama_ffn_dim(o.embed_dim);
    embed_tokens_ = register_module("embed_tokens", nn::Embedding(o.vocab_size, o.embed_dim));
    layers_ = register_module("layers", nn::ModuleList());
    for (int64_t i = 0; i < o.depth; ++i) layers_->push_back(LlamaDecoderLayer(o, ffn));
    norm_ = register_module("norm", RMSNorm(o.embed_dim, o.norm_eps));
    // Tied: the head is the embedding's weight, used, never registered a second time (a second
    // registration would be stepped twice by the optimizer and saved twice).
    if (!o.tie_embeddings) lm_head_ = register_module("lm_head", bias_free(o.embed_dim, o.vocab_size));
    torch::NoGradGuard no_grad;
    for (auto& m : modules(/*include_self=*/false)) {
      if (auto* l = m->as<nn::Linear>()) l->weight.normal_(0.0, o.init_std);
      if (auto* e = m->as<nn::Embedding>()) e->weight.normal_(0.0, o.init_std);
    }
    inv_freq_ = llama_ops::rope_inv_freq(o.embed_dim / o.num_heads, o.rope_theta, o.rope_scaling, torch::kCPU);
  }

  void on_device(const torch::Device& device, const std::string&) override { inv_freq_ = inv_freq_.to(device); }

  torch::Tensor forward(const Batch& batch) override {
    const auto& tokens = batch.at("tokens");
    Structure in;
    torch::Tensor positions;
    if (tokens.dim() == 1) {
      TORCH_CHECK(batch.has("cu_seqlens") && batch.has("position_ids") && batch.meta.count("max_seqlen"),
                  "llama: packed tokens [T] need cu_seqlens, position_ids and meta max_seqlen (collate: pack)");
      in.cu_seqlens = batch.at("cu_seqlens");
      in.max_seqlen = batch.meta.at("max_seqlen");
      positions = batch.at("position_ids");
    } else {
      TORCH_CHECK(tokens.dim() == 2, "llama: tokens must be [B, S] or packed [T], got ", tokens.sizes());
      // Right-padded batches need no key mask under causal attention (models/decoder_lm.cpp says why).
      const auto rp = batch.meta.find("right_padded");
      const bool right_padded = rp != batch.meta.end() && rp->second == 1;
      if (batch.has("padding_mask") && !right_padded) in.key_padding_mask = batch.at("padding_mask");
      positions = batch.has("position_ids") ? batch.at("position_ids")
                                            : torch::arange(tokens.size(1), tokens.options()).unsqueeze(0).expand(tokens.sizes());
    }
    if (inv_freq_.device() != tokens.device()) inv_freq_ = inv_freq_.to(tokens.device());  // moved without on_device
    const auto [cos, sin] = llama_ops::rope_tables(positions, inv_freq_);
    auto x = embed_tokens_(tokens);
    for (auto& layer : *layers_) x = layer->as<LlamaDecoderLayer>()->forward(x, cos, sin, in);
    x = norm_(x);
    return at::linear(x, o_.tie_embeddings ? embed_tokens_->weight : lm_head_->weight);
  }

  std::string default_task() const override { return "language_modeling"; }

 private:
  LlamaOptions o_;
  nn::Embedding embed_tokens_{nullptr};
  nn::ModuleList layers_{nullptr};
  RMSNorm norm_{nullptr};
  nn::Linear lm_head_{nullptr};
  torch::Tensor inv_freq_;  // not a buffer: derived from the config, as HF's non-persistent one
};

std::shared_ptr<Model> make_llama_from_config(config::Section& cfg) {
  LlamaOptions o;
  o.vocab_size = cfg.get_int("vocab_size", 32000, 2);
  o.embed_dim = cfg.get_int("embed_dim", 2048, 2);
  o.depth = cfg.get_int("depth", 16, 1);
  o.num_heads = cfg.get_int("num_heads", 32, 1);
  o.num_kv_heads = cfg.get_int("num_kv_heads", o.num_heads, 1);
  o.ffn_dim = cfg.get_int("ffn_dim", llama_ffn_dim(o.embed_dim), 1);
  o.max_seq_len = cfg.get_int("max_seq_len", 2048, 1);
  o.norm_eps = cfg.get_double("norm_eps", 1e-5, 0.0, 1.0);
  o.rope_theta = cfg.get_double("rope_theta", 10000.0, 1.0);
  o.tie_embeddings = cfg.get_bool("tie_embeddings", false);
  o.init_std = cfg.get_double("init_std", 0.02, 0.0);
  if (o.embed_dim % o.num_heads != 0)
    cfg.fail("num_heads", fmt::format("{} does not divide embed_dim ({})", o.num_heads, o.embed_dim));
  if ((o.embed_dim / o.num_heads) % 2 != 0)
    cfg.fail("num_heads", fmt::format("gives head_dim = embed_dim / num_heads = {} / {} = {}, which is odd: rotary "
                                      "embeddings rotate pairs, so head_dim must be even",
                                      o.embed_dim, o.num_heads, o.embed_dim / o.num_heads));
  if (o.num_heads % o.num_kv_heads != 0)
    cfg.fail("num_kv_heads", fmt::format("{} does not divide num_heads ({}): each K/V head serves a whole group of "
                                         "query heads",
                                         o.num_kv_heads, o.num_heads));
  cfg.accept("rope_scaling");
  if (cfg.has("rope_scaling") && !cfg.is_null("rope_scaling")) {
    config::Section rs = cfg.child("rope_scaling");
    const std::string type = rs.get_choice("rope_type", "llama3", {"llama3"});
    llama_ops::Llama3RopeScaling s;
    s.factor = rs.get_double("factor", 32.0, 1.0);
    s.low_freq_factor = rs.get_double("low_freq_factor", 1.0, 1e-9);
    s.high_freq_factor = rs.get_double("high_freq_factor", 4.0, 1e-9);
    s.original_max_position_embeddings = rs.get_int("original_max_position_embeddings", 8192, 1);
    if (s.high_freq_factor <= s.low_freq_factor)
      rs.fail("high_freq_factor", fmt::format("{} must be above low_freq_factor ({})", s.high_freq_factor, s.low_freq_factor));
    rs.finish();
    o.rope_scaling = s;
  }
  try {
    o.attention = parse_attention_backend(cfg.get_choice("attention", "math", {"custom", "sdpa", "math"}));
  } catch (const std::exception& e) {
    cfg.fail("attention", e.what());
  }
  cfg.finish();
  return make_llama(o);
}

}  // namespace

int64_t llama_ffn_dim(int64_t embed_dim) {
  const int64_t hidden = 2 * (4 * embed_dim) / 3;
  return 256 * ((hidden + 255) / 256);
}

std::shared_ptr<Model> make_llama(const LlamaOptions& options) { return std::make_shared<Llama>(options); }

STROBE_REGISTER(model_registry(), "llama", make_llama_from_config);

}  // namespace strobe::models
