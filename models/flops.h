// The training FLOPs the built-in models declare (Model::training_flops): forward and backward of
// the multiplies that dominate (matrix multiplies, convolutions, attention's two products), 2 FLOPs
// per multiply-add, the backward twice the forward (input and weight gradients), except where no
// input gradient is computed (the first layer of an image model, whose input is data). Bias adds,
// norms and activations are not counted, as in PaLM's model-FLOPs convention and PyTorch's
// torch.utils.flop_counter (tests/python compare these counts with it).
#pragma once

#include <cstdint>
#include <unordered_set>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "strobe/core/throughput.h"
#include "strobe/data/batch.h"

namespace strobe::models {

// The weights of every Linear in `m` (each once): what multiplies each token.
inline double linear_weight_params(const torch::nn::Module& m) {
  double n = 0;
  std::unordered_set<const void*> seen;
  for (const auto& sub : m.modules(/*include_self=*/true))
    if (const auto* l = sub->as<torch::nn::Linear>())
      if (seen.insert(l->weight.unsafeGetTensorImpl()).second) n += static_cast<double>(l->weight.numel());
  return n;
}

// A decoder's training FLOPs over a batch, PaLM's count (appendix B): 6 N per real token for the
// weights (N = `matmul_params`: the Linear weights, a tied head included, the embedding lookup not)
// and 12 L d S per token for attention, S the token's sequence length (each packed document's own
// length when the batch's cu_seqlens are on the host; else the batch's sequence length). Causal
// masking is not discounted, as in the convention.
inline double decoder_training_flops(const Batch& batch, double matmul_params, int64_t layers, int64_t dim) {
  const double tokens = static_cast<double>(batch_tokens(batch));
  double token_positions = 0;  // sum over tokens of their sequence's length
  if (batch.has("cu_seqlens") && batch.at("cu_seqlens").device().is_cpu()) {
    const auto cu = batch.at("cu_seqlens").to(torch::kLong).contiguous();
    const int64_t* p = cu.data_ptr<int64_t>();
    for (int64_t i = 1; i < cu.numel(); ++i) token_positions += static_cast<double>(p[i] - p[i - 1]) * static_cast<double>(p[i] - p[i - 1]);
  } else if (batch.has("tokens")) {
    const auto& t = batch.at("tokens");
    const auto it = batch.meta.find("max_seqlen");
    const double s = t.dim() == 2 ? static_cast<double>(t.size(1)) : it != batch.meta.end() ? static_cast<double>(it->second) : 0;
    token_positions = tokens * s;
  }
  return 6.0 * matmul_params * tokens + 12.0 * static_cast<double>(layers) * static_cast<double>(dim) * token_positions;
}

// Output size of a convolution or pooling window along one axis.
inline int64_t conv_out(int64_t in, int64_t k, int64_t stride, int64_t pad) { return (in + 2 * pad - k) / stride + 1; }

}  // namespace strobe::models
