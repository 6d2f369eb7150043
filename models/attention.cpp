#include "models/attention.h"

#include <limits>
#include <stdexcept>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"

namespace strobe::models {
namespace {

// [B, 1, Sq, Sk] boolean mask, true where attention is allowed (causal bottom-right aligned).
torch::Tensor allowed_mask(int64_t s_q, int64_t s_k, bool causal, const torch::Tensor& key_padding_mask) {
  auto mask = key_padding_mask.to(torch::kBool).view({key_padding_mask.size(0), 1, 1, s_k});
  if (causal) {
    auto tri = torch::ones({s_q, s_k}, mask.options()).tril(s_k - s_q).view({1, 1, s_q, s_k});
    mask = mask & tri;
  }
  return mask;
}

void check_custom_device(const torch::Tensor& q) {
  if (q.is_cuda() && !ops::built_with_cuda()) {
    throw std::runtime_error("attention: custom on CUDA needs strobe_ops built with its CUDA kernels (this build has none)");
  }
}

}  // namespace

void check_attention_on_device(AttentionBackend backend, int64_t head_dim, const torch::Device& device,
                               Precision precision) {
  if (backend != AttentionBackend::Custom || !device.is_cuda()) return;
  if (!ops::built_with_cuda())
    throw config::ConfigError(
        "model.attention: custom on CUDA needs strobe_ops built with its CUDA kernels (this build has none); use sdpa");
  if (precision == Precision::k32)
    throw config::ConfigError(
        "model.attention: custom runs bf16/fp16 heads on CUDA, and trainer.precision 32 gives fp32 ones; use "
        "bf16-mixed, bf16-master or 16-mixed, or attention: sdpa");
  const auto dtype = precision == Precision::k16Mixed ? torch::kHalf : torch::kBFloat16;
  if (!ops::flash_attention_cuda_takes(head_dim, dtype))
    throw config::ConfigError(fmt::format(
        "model.attention: custom on CUDA takes head_dim 64 or 128 (embed_dim / num_heads), this model's is {}; use "
        "attention: sdpa or change num_heads",
        head_dim));
}

AttentionBackend read_attention_backend(config::Section& model) {
  return parse_attention_backend(model.get_choice("attention", "math", {"custom", "sdpa", "math"}));
}

AttentionBackend parse_attention_backend(const std::string& name) {
  if (name == "math") return AttentionBackend::Math;
  if (name == "sdpa") return AttentionBackend::Sdpa;
  if (name == "custom") return AttentionBackend::Custom;
  throw std::invalid_argument("attention: expected custom, sdpa or math, got '" + name + "'");
}

const char* attention_backend_name(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::Math: return "math";
    case AttentionBackend::Sdpa: return "sdpa";
    case AttentionBackend::Custom: return "custom";
  }
  return "?";
}

namespace {

// [..., H_kv, D] -> [..., H_kv * n_rep, D], query head h reading K/V head h / n_rep (Hugging Face's
// repeat_kv order): a copy, for the backends that take as many K/V heads as query heads.
torch::Tensor expand_kv(const torch::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  auto sizes = x.sizes().vec();
  auto expanded = sizes;
  expanded.insert(expanded.end() - 1, n_rep);  // [..., H_kv, n_rep, D]
  sizes[sizes.size() - 2] *= n_rep;
  return x.unsqueeze(-2).expand(expanded).reshape(sizes);
}

// Query heads per K/V head; an error unless the K/V heads divide the query heads.
int64_t kv_groups(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const char* what) {
  const int64_t hq = q.size(-2), hk = k.size(-2);
  TORCH_CHECK(v.size(-2) == hk && hk > 0 && hq % hk == 0, what, ": k and v need the same number of heads, a divisor of "
              "q's (", hq, "), got ", hk, " and ", v.size(-2));
  return hq / hk;
}

}  // namespace

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k_in, const torch::Tensor& v_in, bool causal,
                        const std::optional<torch::Tensor>& key_padding_mask, AttentionBackend backend) {
  TORCH_CHECK(q.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4, "attention: q, k, v must be [B, S, H, D], got ",
              q.sizes(), ", ", k_in.sizes(), ", ", v_in.sizes());
  const int64_t groups = kv_groups(q, k_in, v_in, "attention");
  if (backend == AttentionBackend::Sdpa) {
    // SDPA takes [B, H, S, D]: transposed views of our layout; its flash/cuDNN kernels read the
    // strided views directly and their output transposes back to a contiguous [B, S, H, D]. Grouped
    // K/V heads go in as they are (enable_gqa): no copy at the query heads' count.
    auto t = [](const torch::Tensor& x) { return x.transpose(1, 2); };
    const bool gqa = groups > 1;
    if (!key_padding_mask) {
      return at::scaled_dot_product_attention(t(q), t(k_in), t(v_in), /*attn_mask=*/{}, /*dropout_p=*/0.0, causal,
                                              std::nullopt, gqa)
          .transpose(1, 2);
    }
    auto mask = allowed_mask(q.size(1), k_in.size(1), causal, *key_padding_mask);
    return at::scaled_dot_product_attention(t(q), t(k_in), t(v_in), mask, 0.0, /*is_causal=*/false, std::nullopt, gqa)
        .transpose(1, 2);
  }
  const torch::Tensor k = expand_kv(k_in, groups), v = expand_kv(v_in, groups);
  switch (backend) {
    case AttentionBackend::Math: {
      if (!key_padding_mask) {
        return std::get<0>(ops::flash_attention_reference(q, k, v, std::nullopt, std::nullopt, 0, 0, causal));
      }
      // PyTorch's math SDPA ([B, H, S, D]; transposes are views); softmax in fp32 for half types.
      auto mask = allowed_mask(q.size(1), k.size(1), causal, *key_padding_mask);
      const auto dt = q.scalar_type();
      auto f = [](const torch::Tensor& x) { return x.transpose(1, 2).to(torch::kFloat32); };
      // The math kernel adds its mask: a boolean mask becomes 0 / -inf first (as sdpa() does).
      auto additive = torch::zeros(mask.sizes(), q.options().dtype(torch::kFloat32))
                          .masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
      auto out = std::get<0>(at::_scaled_dot_product_attention_math(f(q), f(k), f(v), additive));
      return out.transpose(1, 2).to(dt);
    }
    case AttentionBackend::Sdpa:
      break;  // above
    case AttentionBackend::Custom:
      if (key_padding_mask) {
        throw std::runtime_error(
            "attention: custom takes no key padding mask; pack the batch instead (data.collate: pack)");
      }
      check_custom_device(q);
      return std::get<0>(ops::flash_attention(q, k, v, causal));
  }
  throw std::logic_error("attention: unknown backend");
}

torch::Tensor attention_varlen(const torch::Tensor& q, const torch::Tensor& k_in, const torch::Tensor& v_in,
                               const torch::Tensor& cu_seqlens, int64_t max_seqlen, bool causal,
                               AttentionBackend backend) {
  TORCH_CHECK(q.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3, "attention_varlen: q, k, v must be [T, H, D], got ",
              q.sizes(), ", ", k_in.sizes(), ", ", v_in.sizes());
  const int64_t groups = kv_groups(q, k_in, v_in, "attention_varlen");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 2, "attention_varlen: cu_seqlens must be [n + 1], got ",
              cu_seqlens.sizes());
  const auto cu = cu_seqlens.to(torch::kInt32);
  const bool half = q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kHalf;
  if (backend == AttentionBackend::Sdpa && q.is_cuda() && half) {
    // The FlashAttention-2 varlen kernel behind torch.nn.attention.varlen (differentiable); it takes
    // grouped K/V heads as they are.
    auto out = at::_flash_attention_forward(q, k_in, v_in, cu, cu, max_seqlen, max_seqlen, 0.0, causal, false);
    return std::get<0>(out);
  }
  const torch::Tensor k = expand_kv(k_in, groups), v = expand_kv(v_in, groups);
  switch (backend) {
    case AttentionBackend::Custom:
      check_custom_device(q);
      return std::get<0>(ops::flash_attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, causal));
    case AttentionBackend::Sdpa:
      [[fallthrough]];
    case AttentionBackend::Math:
      return std::get<0>(ops::flash_attention_reference(q, k, v, cu, cu, max_seqlen, max_seqlen, causal));
  }
  throw std::logic_error("attention_varlen: unknown backend");
}

TokenLayout token_layout(const Batch& batch, const char* model) {
  const auto& tokens = batch.at("tokens");
  TokenLayout out;
  if (tokens.dim() == 1) {
    TORCH_CHECK(batch.has("cu_seqlens") && batch.has("position_ids") && batch.meta.count("max_seqlen"), model,
                ": packed tokens [T] need cu_seqlens, position_ids and meta max_seqlen (collate: pack)");
    out.cu_seqlens = batch.at("cu_seqlens");
    out.max_seqlen = batch.meta.at("max_seqlen");
    out.positions = batch.at("position_ids");
    return out;
  }
  TORCH_CHECK(tokens.dim() == 2, model, ": tokens must be [B, S] or packed [T], got ", tokens.sizes());
  const auto rp = batch.meta.find("right_padded");
  const bool right_padded = rp != batch.meta.end() && rp->second == 1;
  if (batch.has("padding_mask") && !right_padded) out.key_padding_mask = batch.at("padding_mask");
  out.positions = batch.has("position_ids") ? batch.at("position_ids") : torch::arange(tokens.size(1), tokens.options()).unsqueeze(0);
  return out;
}

}  // namespace strobe::models
