// Helpers shared by flash_attention.cpp and its CUDA glue (not part of the public API).
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace strobe::ops::detail {

struct FlashShape {
  bool varlen = false;
  int64_t batch = 0, heads = 0, head_dim = 0;
  int64_t seqlen_q = 0, seqlen_k = 0;  // fixed: the lengths; varlen: max_seqlen_q/k
};

// Checks every device shares (layout, dtypes, heads, cu_seqlens, scale); throws with one clear line.
FlashShape flash_check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& cu_seqlens_q,
                              const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                              int64_t max_seqlen_k, double softmax_scale);
// softmax_scale or 1/sqrt(head_dim).
double resolve_scale(const at::Tensor& q, std::optional<double> softmax_scale);

}  // namespace strobe::ops::detail
