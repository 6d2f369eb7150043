// Attention backends shared by vit and decoder_lm, chosen by the `attention:` model key.
//   math   the reference strobe::ops::flash_attention_reference (ATen ops, fp32 softmax, any device
//          and dtype); with a key-padding mask, PyTorch's own math SDPA.
//   sdpa   at::scaled_dot_product_attention (flash / memory-efficient / cuDNN / math, chosen by
//          PyTorch); packed sequences on CUDA in fp16/bf16 go to at::_flash_attention_forward with
//          cu_seqlens (the varlen kernel), elsewhere to the reference.
//   custom strobe::flash_attention (our kernel on CUDA: bf16/fp16, head_dim 64/128; the reference
//          on CPU). It takes no key-padding mask: pack the batch (varlen) instead.
//
// Layouts: padded q, k, v are [B, S, H, D] (a view of the fused qkv projection; no permute copy);
// packed ones are [T, H, D] with cu_seqlens (int32 [n + 1], on the tensors' device) and max_seqlen
// given on the host, so no call reads the device. Outputs have the same layout as q.
#pragma once

#include <optional>
#include <string>

#include <torch/types.h>

#include "strobe/config/config.h"
#include "strobe/config/precision.h"
#include "strobe/data/batch.h"

namespace strobe::models {

enum class AttentionBackend { Math, Sdpa, Custom };

// "math" | "sdpa" | "custom"; throws std::invalid_argument on anything else.
AttentionBackend parse_attention_backend(const std::string& name);
// The `attention:` key of a model section (default math); another value is a config error naming it.
AttentionBackend read_attention_backend(config::Section& model);
const char* attention_backend_name(AttentionBackend backend);

// Before training (a model's on_device): whether `backend` can run heads of `head_dim` on `device`
// under trainer.precision `precision`. `custom` on CUDA needs strobe_ops' CUDA kernels, bf16/fp16
// activations (bf16-mixed, 16-mixed, bf16-master: not 32) and a head_dim they take (64 or 128);
// anything else is a config::ConfigError naming model.attention, the value at fault and what would
// run instead, so the run exits 2 before its first step instead of failing inside it.
void check_attention_on_device(AttentionBackend backend, int64_t head_dim, const torch::Device& device,
                               Precision precision);

// q [B, Sq, H, D], k/v [B, Sk, H_kv, D] -> [B, Sq, H, D]. key_padding_mask: optional [B, Sk] bool,
// true for real tokens (keys that may be attended to); not with `custom`. Grouped-query K/V
// (H_kv dividing H; query head h reads K/V head h / (H / H_kv)): `sdpa` takes them as they are
// (enable_gqa, and the varlen FlashAttention-2 kernel), `math` and `custom` get copies expanded to H.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                        const std::optional<torch::Tensor>& key_padding_mask, AttentionBackend backend);

// Packed (varlen) attention: sequence i is rows [cu_seqlens[i], cu_seqlens[i+1]); no token attends
// across sequences. Returns [T, H, D].
torch::Tensor attention_varlen(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& cu_seqlens, int64_t max_seqlen, bool causal,
                               AttentionBackend backend);

// How a token batch reaches attention (decoder_lm, llama), read from the token collates' layouts
// (strobe/data/collate_tokens.h):
//   padded: batch["tokens"] [B, S]; "padding_mask" [B, S] (true = real token) becomes the key mask
//           unless batch.meta["right_padded"] == 1: causal attention over right-padded sequences needs
//           none (a real token at t only sees keys 0..t, all real; the outputs at padding positions
//           change, and the loss ignores them), so every backend runs its plain causal kernel.
//           Positions: "position_ids" [B, S], default [1, S] = 0..S-1 (broadcast over the batch).
//   packed: batch["tokens"] [T] with "cu_seqlens" [n + 1] int32, "position_ids" [T] and meta
//           "max_seqlen" (host); attention never crosses a sequence boundary.
struct TokenLayout {
  std::optional<torch::Tensor> key_padding_mask;
  torch::Tensor cu_seqlens;  // defined: packed
  int64_t max_seqlen = 0;
  torch::Tensor positions;
  bool packed() const { return cu_seqlens.defined(); }
};
// Throws c10::Error naming `model` for tokens of another rank or a packed batch missing its keys.
TokenLayout token_layout(const Batch& batch, const char* model);

}  // namespace strobe::models
