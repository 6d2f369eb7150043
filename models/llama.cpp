#include "models/llama.h"

#include <optional>

#include <torch/torch.h>

#include <fmt/format.h>

#include "models/flops.h"
#include "models/layers.h"
#include "strobe/config/config.h"
#include "strobe/core/forensics.h"
#include "strobe/core/memory_budget.h"
#include "strobe/core/weight_names.h"
#include "strobe/ops/ops.h"

namespace strobe::models {
namespace {

namespace nn = torch::nn;

// A block whose parameter-free ops (RMSNorm's pow and mean, rotary and attention, SwiGLU's silu)
// `strobe replay` names by the block's path (`layers.3.input_layernorm`) instead of the module that
// ran last: Llama sets `path` once its modules are registered.
struct ScopedBlock {
  std::string path;
};

class RMSNormImpl : public nn::Module, public ScopedBlock {
 public:
  RMSNormImpl(int64_t dim, double eps) : eps_(eps) { weight = register_parameter("weight", torch::ones({dim})); }
  torch::Tensor forward(const torch::Tensor& x) {
    ModuleScope scope(path.c_str());
    return llama_ops::rms_norm(x, weight, eps_);
  }
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// (res + delta, norm(res + delta)) through strobe::add_rms_norm, named by the norm's path for
// `strobe replay`. The two take their promoted dtype first, as ATen's `res + delta` does: under
// autocast (bf16-mixed) the residual stream is fp32 while the projections return bf16.
// y_amax: when not null, the norm's output amax too (strobe::add_rms_norm_amax), for the float8
// linear layers that read it (trainer.fp8).
std::tuple<torch::Tensor, torch::Tensor> residual_rms_norm(const torch::Tensor& res, const torch::Tensor& delta,
                                                          RMSNormImpl& norm, double eps,
                                                          std::optional<torch::Tensor>* y_amax = nullptr) {
  ModuleScope scope(norm.path.c_str());
  const auto dt = at::promote_types(res.scalar_type(), delta.scalar_type());
  if (y_amax == nullptr) return ops::add_rms_norm(res.to(dt), delta.to(dt), norm.weight, eps);
  auto [sum, y, amax] = ops::add_rms_norm_amax(res.to(dt), delta.to(dt), norm.weight, eps);
  *y_amax = amax;
  return {sum, y};
}

nn::Linear bias_free(int64_t in, int64_t out) { return nn::Linear(nn::LinearOptions(in, out).bias(false)); }

class LlamaAttentionImpl : public nn::Module, public ScopedBlock {
 public:
  LlamaAttentionImpl(int64_t dim, int64_t heads, int64_t kv_heads, AttentionBackend backend)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(dim / heads), backend_(backend) {
    q_proj = register_module("q_proj", bias_free(dim, heads * head_dim_));
    k_proj = register_module("k_proj", bias_free(dim, kv_heads * head_dim_));
    v_proj = register_module("v_proj", bias_free(dim, kv_heads * head_dim_));
    o_proj = register_module("o_proj", bias_free(heads * head_dim_, dim));
  }

  // x [B, S, C] or packed [T, C]; cos/sin [B, S, D] or [T, D].
  // fused: q and k rotated by strobe::rotary_qk in one kernel (cos / sin then have one row per token).
  // x_amax: max |x| from the norm that wrote x, for the projections that run in float8.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const TokenLayout& in,
                        bool fused = false, const std::optional<torch::Tensor>& x_amax = std::nullopt) {
    ModuleScope scope(path.c_str());
    auto lead = x.sizes().vec();
    lead.pop_back();
    auto heads = [&](const torch::Tensor& t, int64_t n) {
      auto shape = lead;
      shape.push_back(n);
      shape.push_back(head_dim_);
      return t.view(shape);
    };
    torch::Tensor q = heads(linear(q_proj, x, x_amax), heads_), k = heads(linear(k_proj, x, x_amax), kv_heads_);
    if (fused) {
      std::tie(q, k) = ops::rotary_qk(q, k, cos, sin);
    } else {
      q = llama_ops::apply_rotary(q, cos, sin);
      k = llama_ops::apply_rotary(k, cos, sin);
    }
    auto v = heads(linear(v_proj, x, x_amax), kv_heads_);
    // Grouped K/V heads as they are: attention() expands them only for backends that need it.
    torch::Tensor a = in.cu_seqlens.defined()
                          ? attention_varlen(q, k, v, in.cu_seqlens, in.max_seqlen, /*causal=*/true, backend_)
                          : attention(q, k, v, /*causal=*/true, in.key_padding_mask, backend_);
    auto out_shape = lead;
    out_shape.push_back(heads_ * head_dim_);
    return linear(o_proj, a.reshape(out_shape));
  }

  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  int64_t heads_, kv_heads_, head_dim_;
  AttentionBackend backend_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public nn::Module, public ScopedBlock {
 public:
  LlamaMLPImpl(int64_t dim, int64_t hidden) {
    gate_proj = register_module("gate_proj", bias_free(dim, hidden));
    up_proj = register_module("up_proj", bias_free(dim, hidden));
    down_proj = register_module("down_proj", bias_free(hidden, dim));
  }
  // fused: gate and up in one GEMM against the two weights stacked (the parameters stay apart, so names,
  // init_from, export and checkpoints are unchanged), then strobe::swiglu on its [..., 2 x ffn] output.
  // trainer.fp8: that GEMM runs in float8 when gate_proj and up_proj are both marked, through
  // strobe::fp8_linear_swiglu, whose swiglu kernels give the amax of their outputs to the float8 casts
  // (down_proj's input; d gate_up in the backward).
  torch::Tensor forward(const torch::Tensor& x, bool fused = false, const std::optional<torch::Tensor>& x_amax = std::nullopt) {
    ModuleScope scope(path.c_str());
    const bool fp8_gate_up = fp8_marked(*gate_proj) && fp8_marked(*up_proj);
    if (!fused) {
      if (!fp8_gate_up && !fp8_marked(*down_proj))
        return llama_ops::swiglu(x, gate_proj->weight, up_proj->weight, down_proj->weight);
      return linear(down_proj, at::silu(linear(gate_proj, x)) * linear(up_proj, x));
    }
    const auto w = at::cat({gate_proj->weight, up_proj->weight}, 0);
    if (fp8_gate_up) {
      const auto [h, h_amax] = linear_swiglu_in_fp8(x, w, x_amax);
      return fp8_marked(*down_proj) ? linear_in_fp8(h, down_proj->weight, std::nullopt, h_amax) : linear(down_proj, h);
    }
    return linear(down_proj, ops::swiglu(at::linear(x, w)));
  }
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
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, const TokenLayout& in) {
    x = x + self_attn->forward(input_layernorm(x), cos, sin, in);
    return x + mlp(post_attention_layernorm(x));
  }

  // The fused path: the residual stream is res + pending between blocks, and every residual add runs
  // inside strobe::add_rms_norm with the RMSNorm after it (one read of both, the sum written once).
  // Returns (the stream before this block's MLP output is added, that output).
  std::pair<torch::Tensor, torch::Tensor> forward_fused(const torch::Tensor& res, const torch::Tensor& pending,
                                                        const torch::Tensor& cos, const torch::Tensor& sin,
                                                        const TokenLayout& in, double eps) {
    // trainer.fp8: the norms after a residual add give the amax of their outputs to the float8
    // projections that read them (the first block's plain RMSNorm leaves it to the cast).
    std::optional<torch::Tensor> attn_amax, mlp_amax;
    const bool attn_fp8 = fp8_marked(*self_attn->q_proj) || fp8_marked(*self_attn->k_proj) || fp8_marked(*self_attn->v_proj);
    const bool mlp_fp8 = fp8_marked(*mlp->gate_proj) && fp8_marked(*mlp->up_proj);
    torch::Tensor x, h;
    if (pending.defined()) {
      std::tie(x, h) = residual_rms_norm(res, pending, *input_layernorm, eps, attn_fp8 ? &attn_amax : nullptr);
    } else {
      ModuleScope scope(input_layernorm->path.c_str());
      x = res;
      h = ops::rms_norm(res, input_layernorm->weight, eps);
    }
    std::tie(x, h) = residual_rms_norm(x, self_attn->forward(h, cos, sin, in, /*fused=*/true, attn_amax),
                                       *post_attention_layernorm, eps, mlp_fp8 ? &mlp_amax : nullptr);
    return {x, mlp->forward(h, /*fused=*/true, mlp_amax)};
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
    for (auto& item : named_modules("", /*include_self=*/false)) {
      if (auto* b = dynamic_cast<ScopedBlock*>(item.value().get())) b->path = item.key();
    }
    torch::NoGradGuard no_grad;
    for (auto& m : modules(/*include_self=*/false)) {
      if (auto* l = m->as<nn::Linear>()) l->weight.normal_(0.0, o.init_std);
      if (auto* e = m->as<nn::Embedding>()) e->weight.normal_(0.0, o.init_std);
    }
    inv_freq_ = llama_ops::rope_inv_freq(o.embed_dim / o.num_heads, o.rope_theta, o.rope_scaling, torch::kCPU);
  }

  void on_device(const torch::Device& device, Precision precision) override {
    check_attention_on_device(o_.attention, o_.embed_dim / o_.num_heads, device, precision);
    inv_freq_ = inv_freq_.to(device);
  }

  torch::Tensor forward(const Batch& batch) override {
    const auto head = forward_head_input(batch);
    if (!head.module) return at::linear(head.hidden, head.weight);
    return run_in_unit(*head.module, head.hidden, [w = head.weight](const torch::Tensor& h) { return at::linear(h, w); });
  }

  int64_t head_input_vocab() const override { return o_.vocab_size; }
  HeadInput forward_head_input(const Batch& batch) override {
    const auto& tokens = batch.at("tokens");
    const TokenLayout in = token_layout(batch, "llama");  // padded (mask only if not right-padded) or packed
    if (inv_freq_.device() != tokens.device()) inv_freq_ = inv_freq_.to(tokens.device());  // moved without on_device
    const auto [cos, sin] = llama_ops::rope_tables(in.positions, inv_freq_);
    // An untied embedding and head are units of their own under fsdp (fsdp_units), gathered around them.
    auto x = run_in_unit(*embed_tokens_, tokens, [this](const torch::Tensor& t) { return embed_tokens_(t); });
    const auto& head = o_.tie_embeddings ? embed_tokens_->weight : lm_head_->weight;
    torch::nn::Module* head_module = o_.tie_embeddings ? nullptr : lm_head_.get();
    if (use_fused(x)) {
      // strobe::rotary_qk takes one table row per token: the [1, S, D] tables of default positions are
      // expanded over the batch once per forward (a few MiB), not per layer.
      auto c = cos, s = sin;
      if (c.dim() == 3 && c.size(0) != tokens.size(0)) {
        c = c.expand({tokens.size(0), c.size(1), c.size(2)}).contiguous();
        s = s.expand({tokens.size(0), s.size(1), s.size(2)}).contiguous();
      }
      torch::Tensor pending;
      const double eps = o_.norm_eps;
      for (size_t i = 0; i < layers_->size(); ++i) {
        auto layer = layers_->ptr<LlamaDecoderLayerImpl>(i);
        std::tie(x, pending) = run_block(o_.activation_checkpointing, static_cast<int64_t>(i), *layer, x, pending,
                                         [layer, c, s, in, eps](const torch::Tensor& r, const torch::Tensor& p) {
                                           return layer->forward_fused(r, p, c, s, in, eps);
                                         });
      }
      return {std::get<1>(residual_rms_norm(x, pending, *norm_, o_.norm_eps)), head, std::nullopt, head_module};
    }
    for (size_t i = 0; i < layers_->size(); ++i) {
      auto layer = layers_->ptr<LlamaDecoderLayerImpl>(i);
      x = run_block(o_.activation_checkpointing, static_cast<int64_t>(i), *layer, x,
                    [layer, c = cos, s = sin, in](const torch::Tensor& t) { return layer->forward(t, c, s, in); });
    }
    return {norm_(x), head, std::nullopt, head_module};
  }

  std::string default_task() const override { return "language_modeling"; }
  std::vector<std::string> batch_keys() const override { return {"tokens"}; }
  // Layer-wise lr decay: the embedding 0 (a tied head is that weight: layer 0), decoder layer i
  // layer i + 1, the final norm with the last decoder layer (as timm places a final norm), an untied
  // lm_head depth + 1.
  int64_t num_layers() const override { return o_.depth + (o_.tie_embeddings ? 1 : 2); }
  // The decoder layers' projections (q, k, v, o, gate, up, down), not the embedding or the head.
  std::vector<std::string> fp8_layers() const override { return {"layers.*"}; }
  // A tied embedding and head stay in the kept unit (the head runs last, the embedding first).
  std::vector<std::string> fsdp_units() const override {
    if (o_.tie_embeddings) return {"layers.*"};
    return {"embed_tokens", "layers.*", "lm_head"};
  }
  int64_t layer_of(const std::string& p) const override {
    if (p.rfind("embed_tokens.", 0) == 0) return 0;
    if (const int64_t i = list_index(p, "layers"); i >= 0) return i + 1;
    if (p.rfind("norm.", 0) == 0) return o_.depth;
    return num_layers() - 1;
  }
  // PaLM's count (models/flops.h); a tied head multiplies by the embedding's weight.
  double training_flops(const Batch& batch) const override {
    if (matmul_params_ < 0)
      matmul_params_ = linear_weight_params(*this) + (o_.tie_embeddings ? static_cast<double>(o_.vocab_size * o_.embed_dim) : 0.0);
    return decoder_training_flops(batch, matmul_params_, o_.depth, o_.embed_dim);
  }

 private:
  // model.fused_ops (models/fused_ops.h): auto takes the fused RMSNorm where its CUDA kernel takes the
  // stream (and the norm weights do not promote it: y keeps the stream's dtype); true always (the
  // ATen reference on CPU), false never.
  bool use_fused(const torch::Tensor& x) const {
    if (!use_fused_ops(o_.fused_ops, x, "llama")) return false;
    const bool promotes = at::promote_types(x.scalar_type(), norm_->weight.scalar_type()) != x.scalar_type();
    TORCH_CHECK(!(promotes && o_.fused_ops == FusedOps::kOn), "llama: fused_ops: true: strobe::add_rms_norm keeps the ",
                "stream's dtype, but the ", norm_->weight.scalar_type(), " norm weights would promote the ",
                x.scalar_type(), " stream; set model.fused_ops: auto or false");
    return !promotes;
  }

  LlamaOptions o_;
  mutable double matmul_params_ = -1;  // training_flops: counted on first use
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
  o.attention = read_attention_backend(cfg);
  o.fused_ops = parse_fused_ops(cfg.get_choice("fused_ops", "auto", {"auto", "true", "false"}));
  o.activation_checkpointing = ActivationCheckpointing::read(cfg);
  cfg.finish();
  {
    // Before a byte is allocated: a shape this machine cannot hold is refused naming the key behind it.
    const double e = static_cast<double>(o.embed_dim), v = static_cast<double>(o.vocab_size),
                 f = static_cast<double>(o.ffn_dim), kv = static_cast<double>(o.num_kv_heads * (o.embed_dim / o.num_heads));
    const double attention = 2 * e * e + 2 * e * kv, mlp = 3 * e * f, embedding = v * e * (o.tie_embeddings ? 1 : 2);
    const double params = embedding + static_cast<double>(o.depth) * (attention + mlp + 2 * e) + e;
    check_parameters_fit(cfg, params, {{"embed_dim", attention}, {"ffn_dim", mlp}, {"vocab_size", embedding}}, "depth",
                         fmt::format("embed_dim {}, depth {}, ffn_dim {}, vocab_size {}", o.embed_dim, o.depth, o.ffn_dim, o.vocab_size));
  }
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
