// llama: a Llama-style decoder in the layout of Hugging Face's LlamaForCausalLM: token embedding,
// pre-norm blocks (RMSNorm; attention with rotary position embeddings and grouped-query K/V; SwiGLU
// MLP), a final RMSNorm and the output head, which may be the embedding's own weight (tied). No
// biases. Parameter names are HF's without its "model." prefix (embed_tokens.weight,
// layers.<i>.self_attn.q_proj.weight, layers.<i>.mlp.gate_proj.weight, norm.weight, lm_head.weight),
// and the rotary convention is HF's (rotate-half over the two halves of each head), so its weights
// map one to one. The numerics of each step are models/llama_ops.h, the seam for fused kernels.
//
// Input: the token collates' padded or packed batches, as decoder_lm takes them (models/decoder_lm.h):
// positions come from "position_ids" (restarting per document when packed) and feed the rotary
// tables. Output: logits [B, S, vocab] or [T, vocab].
//
// Attention: the models/attention.h backends, given the K/V heads as they are: `sdpa` attends with
// grouped K/V natively (no copy); `math` and `custom` expand them to the query heads first.
//
// fused_ops (auto | true | false, models/fused_ops.h): every residual add and the RMSNorm after it
// run as strobe::add_rms_norm (one kernel forward, one backward), q and k are rotated by
// strobe::rotary_qk (one kernel for both), and the MLP's gate and up projections run as one GEMM
// (the weights stacked per forward) followed by strobe::swiglu, in the same numerics as the ATen
// path; parameters and names are the same either way.
#pragma once

#include <memory>
#include <optional>

#include "strobe/core/activation_checkpoint.h"
#include "strobe/core/model.h"
#include "models/attention.h"
#include "models/fused_ops.h"
#include "models/llama_ops.h"

namespace strobe::models {

struct LlamaOptions {
  int64_t vocab_size = 32000, embed_dim = 2048, depth = 16, num_heads = 32, num_kv_heads = 32;
  int64_t ffn_dim = 0;  // 0: llama_ffn_dim(embed_dim)
  int64_t max_seq_len = 2048;
  double norm_eps = 1e-5, rope_theta = 10000.0;
  std::optional<llama_ops::Llama3RopeScaling> rope_scaling;
  bool tie_embeddings = false;
  AttentionBackend attention = AttentionBackend::Math;
  FusedOps fused_ops = FusedOps::kAuto;  // models/fused_ops.h
  double init_std = 0.02;  // HF's initializer_range: every Linear and Embedding weight ~ N(0, std)
  ActivationCheckpointing activation_checkpointing;  // over the decoder layers (strobe/core/activation_checkpoint.h)
};

// Meta's rule for the SwiGLU width: 2/3 of 4 * embed_dim, rounded up to a multiple of 256
// (4096 -> 11008).
int64_t llama_ffn_dim(int64_t embed_dim);

std::shared_ptr<Model> make_llama(const LlamaOptions& options);

}  // namespace strobe::models
