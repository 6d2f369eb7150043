#include "models/attention.h"

#include <cmath>
#include <stdexcept>

#include <torch/torch.h>

namespace strobe::models {
namespace {

constexpr const char* kCustomMissing =
    "attention: custom needs the strobe::flash_attention op, which is not built yet";

// [B, 1, S, S] (or [1, 1, S, S]) boolean mask, true where attention is allowed; nullopt for none.
std::optional<torch::Tensor> allowed_mask(int64_t s_q, int64_t s_k, bool causal,
                                          const std::optional<torch::Tensor>& key_padding_mask,
                                          const torch::Device& device) {
  std::optional<torch::Tensor> mask;
  if (causal) {
    mask = torch::ones({s_q, s_k}, torch::TensorOptions().dtype(torch::kBool).device(device)).tril().view({1, 1, s_q, s_k});
  }
  if (key_padding_mask) {
    auto keep = key_padding_mask->to(torch::kBool).view({key_padding_mask->size(0), 1, 1, s_k});
    mask = mask ? (*mask & keep) : keep;
  }
  return mask;
}

torch::Tensor attention_math(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::optional<torch::Tensor>& mask) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * scale;
  // Softmax in fp32 whatever the input dtype (as SDPA's math backend does for half types).
  scores = scores.to(torch::kFloat32);
  if (mask) scores = scores.masked_fill(mask->logical_not(), -std::numeric_limits<float>::infinity());
  auto probs = torch::softmax(scores, -1).to(v.scalar_type());
  return torch::matmul(probs, v);
}

// For each packed row t: its sequence and its position within it, [T] int64 each, on the device.
std::pair<torch::Tensor, torch::Tensor> packed_coordinates(const torch::Tensor& cu_seqlens, int64_t total) {
  auto cu = cu_seqlens.to(torch::kLong);
  auto t = torch::arange(total, cu.options());
  auto seq = torch::searchsorted(cu.slice(0, 1), t, /*out_int32=*/false, /*right=*/true);
  auto pos = t - cu.index_select(0, seq);
  return {seq, pos};
}

// Packed -> [n, H, max_seqlen, D] by a gather (rows past a sequence's end repeat a valid row and
// are masked as keys), plus the [n, max_seqlen] key mask. No host read of cu_seqlens.
std::pair<torch::Tensor, torch::Tensor> unpack_index(const torch::Tensor& cu_seqlens, int64_t max_seqlen, int64_t total) {
  auto cu = cu_seqlens.to(torch::kLong);
  auto starts = cu.slice(0, 0, -1), lengths = cu.slice(0, 1) - starts;
  auto pos = torch::arange(max_seqlen, cu.options());
  auto keep = pos.unsqueeze(0) < lengths.unsqueeze(1);
  auto index = (starts.unsqueeze(1) + pos.unsqueeze(0)).clamp_max(std::max<int64_t>(total - 1, 0));
  return {index, keep};
}

}  // namespace

AttentionBackend parse_attention_backend(const std::string& name) {
  if (name == "math") return AttentionBackend::Math;
  if (name == "sdpa") return AttentionBackend::Sdpa;
  if (name == "custom") {
    auto handle = c10::Dispatcher::singleton().findSchema({"strobe::flash_attention", ""});
    if (!handle) throw std::runtime_error(kCustomMissing);
    return AttentionBackend::Custom;
  }
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

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                        const std::optional<torch::Tensor>& key_padding_mask, AttentionBackend backend) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k, v must be [B, H, S, D], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  switch (backend) {
    case AttentionBackend::Math:
      return attention_math(q, k, v, allowed_mask(q.size(2), k.size(2), causal, key_padding_mask, q.device()));
    case AttentionBackend::Sdpa: {
      if (!key_padding_mask) {
        return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, causal);
      }
      auto mask = allowed_mask(q.size(2), k.size(2), causal, key_padding_mask, q.device());
      return at::scaled_dot_product_attention(q, k, v, *mask, 0.0, /*is_causal=*/false);
    }
    case AttentionBackend::Custom:
      throw std::runtime_error(kCustomMissing);
  }
  throw std::logic_error("attention: unknown backend");
}

torch::Tensor attention_varlen(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& cu_seqlens, int64_t max_seqlen, bool causal,
                               AttentionBackend backend) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attention_varlen: q, k, v must be [T, H, D], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 2, "attention_varlen: cu_seqlens must be [n + 1], got ",
              cu_seqlens.sizes());
  if (backend == AttentionBackend::Custom) throw std::runtime_error(kCustomMissing);
  const bool half = q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kHalf;
  if (backend == AttentionBackend::Sdpa && q.is_cuda() && half) {
    // The FlashAttention-2 varlen kernel behind torch.nn.attention.varlen (differentiable).
    auto cu = cu_seqlens.to(torch::kInt32);
    auto out = at::_flash_attention_forward(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, causal, false);
    return std::get<0>(out);
  }
  const int64_t total = q.size(0);
  auto [index, keep] = unpack_index(cu_seqlens, max_seqlen, total);
  const int64_t n = index.size(0);
  auto unpack = [&](const torch::Tensor& x) {  // [T, H, D] -> [n, H, S, D]
    return x.index_select(0, index.flatten()).view({n, max_seqlen, x.size(1), x.size(2)}).transpose(1, 2);
  };
  auto out = attention(unpack(q), unpack(k), unpack(v), causal, keep, backend);  // [n, H, S, D]
  auto [seq, pos] = packed_coordinates(cu_seqlens, total);
  return out.transpose(1, 2).reshape({n * max_seqlen, q.size(1), v.size(2)}).index_select(0, seq * max_seqlen + pos);
}

}  // namespace strobe::models
