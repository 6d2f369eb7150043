// Attention backends shared by vit and decoder_lm, chosen by the `attention:` model key.
//   math   the reference: softmax(q k^T / sqrt(d) + mask) v in ATen ops, on every device and dtype.
//   sdpa   at::scaled_dot_product_attention (flash / memory-efficient / cuDNN / math, chosen by
//          PyTorch); packed sequences on CUDA in fp16/bf16 go to at::_flash_attention_forward with
//          cu_seqlens (the varlen kernel), elsewhere they are unpacked and masked.
//   custom strobe::flash_attention (our kernel); until that op is built, choosing it is an error.
//
// Layouts: padded q, k, v are [B, H, S, D]; packed ones are [T, H, D] with cu_seqlens (int32
// [n + 1], on the tensors' device) and max_seqlen given on the host, so no call reads the device.
#pragma once

#include <optional>
#include <string>

#include <torch/types.h>

namespace strobe::models {

enum class AttentionBackend { Math, Sdpa, Custom };

// "math" | "sdpa" | "custom"; throws std::invalid_argument on anything else. `custom` throws
// std::runtime_error while no strobe::flash_attention op exists, so a config fails at build time.
AttentionBackend parse_attention_backend(const std::string& name);
const char* attention_backend_name(AttentionBackend backend);

// key_padding_mask: optional [B, S] bool, true for real tokens (keys that may be attended to).
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                        const std::optional<torch::Tensor>& key_padding_mask, AttentionBackend backend);

// Packed (varlen) attention: sequence i is rows [cu_seqlens[i], cu_seqlens[i+1]); no token attends
// across sequences. Returns [T, H, D].
torch::Tensor attention_varlen(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& cu_seqlens, int64_t max_seqlen, bool causal,
                               AttentionBackend backend);

}  // namespace strobe::models
