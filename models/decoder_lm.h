// GPT-style decoder, the seed's (varlen-transformer.txt): token + learned position embeddings,
// pre-LN blocks with bias-free LayerNorm, fused qkv (with bias), GELU MLP, output head; causal.
//
// Input, either layout the token collates produce (strobe/data/collate_tokens.h):
//   padded: batch["tokens"] [B, S] int64, optional "padding_mask" [B, S] bool (true = real token;
//           padding keys are masked out) and "position_ids" [B, S] (default 0..S-1). When
//           batch.meta["right_padded"] == 1 (the padded token collates set it) the mask is not
//           needed and not used: causal attention alone keeps real tokens away from the padding.
//   packed: batch["tokens"] [T] int64 with "cu_seqlens" [n + 1] int32, "position_ids" [T], and
//           batch.meta["max_seqlen"] (host), attention never crossing a sequence boundary.
// Output: logits [B, S, vocab] or [T, vocab], in the layout of the input.
#pragma once

#include <memory>
#include <string>

#include "strobe/core/activation_checkpoint.h"
#include "strobe/core/model.h"
#include "models/attention.h"
#include "models/fused_ops.h"

namespace strobe::models {

struct DecoderLMOptions {
  int64_t vocab_size = 1024, max_seq_len = 1024, embed_dim = 1024, depth = 24, num_heads = 16;
  double mlp_ratio = 4.0;
  AttentionBackend attention = AttentionBackend::Math;
  FusedOps fused_ops = FusedOps::kAuto;  // models/fused_ops.h
  ActivationCheckpointing activation_checkpointing;  // over the blocks (strobe/core/activation_checkpoint.h)
  std::string gelu = "erf";  // erf (exact) | tanh (the approximation; strobe::fused_mlp with fused ops)
};

std::shared_ptr<Model> make_decoder_lm(const DecoderLMOptions& options);

}  // namespace strobe::models
