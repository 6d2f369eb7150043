// Collate strategies for variable-length token sequences. Each sample holds "tokens" [L] and
// "targets" [L] int64 (targets[t] = the token after tokens[t], already shifted by the dataset).
//
//   pad_to_max      [B, max_len] — one shape for every batch (the seed's baseline).
//   pad_to_longest  [B, longest in the batch].
//     Both give tokens (pad 0), targets (pad -100, the loss's ignore_index), position_ids
//     (0..L-1, 0 at padding), padding_mask (bool, true = real token), lengths [B] int64.
//   pack            everything concatenated: tokens/targets/position_ids [T], cu_seqlens [B + 1]
//                   int32 (offsets of each sequence), lengths [B] int64.
// A mix's samples (strobe/data/mix.h) add source [B] int64, each sequence's source, and in meta
// source/<s> = the sequences of source s.
// meta (host): batch_size = B, max_seqlen = longest sequence, num_tokens = real tokens in the batch,
// seq_len = padded length and right_padded = 1 (padded layouts: every sequence starts at position 0
// and its padding follows it, which lets a causal model drop the key-padding mask). max_seqlen on the host is what a varlen attention kernel
// needs at launch, so no device-to-host read is ever needed.
#pragma once

#include <string>
#include <vector>

#include "strobe/data/dataset.h"

namespace strobe::data {

constexpr int64_t kPadToken = 0;
constexpr int64_t kIgnoreTarget = -100;

// pad_len > 0: pad every sequence to pad_len (a longer one is an error); pad_len <= 0: to the longest.
Batch collate_tokens_padded(std::vector<Sample>& samples, int64_t pad_len);
Batch collate_tokens_packed(std::vector<Sample>& samples);

// "pad_to_max" | "pad_to_longest" | "pack" (std::invalid_argument otherwise).
CollateFn make_token_collate(const std::string& strategy, int64_t max_len);
const std::vector<std::string>& token_collate_names();

}  // namespace strobe::data
