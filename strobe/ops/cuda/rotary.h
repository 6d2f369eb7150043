// Launcher of the rotary-embedding kernel (op strobe::rotary_qk, strobe/ops/rotary*.cpp): raw
// pointers, sizes and a stream only, no torch header. Enqueues on `stream` and never syncs.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "strobe/ops/cuda/dtype.h"

namespace strobe::ops::cuda {

// q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim], contiguous, of `dtype` (fp32,
// fp16, bf16); cos / sin [tokens, head_dim] fp32, contiguous. With h = head_dim / 2, c = dtype(cos),
// s = dtype(sin) and every product and sum rounded to dtype as Hugging Face's ATen ops round them:
//   forward:  out[i] = x[i] * c[i] - x[i + h] * s[i],  out[i + h] = x[i + h] * c[i + h] + x[i] * s[i + h]
//   backward: dx[i] = dy[i] * c[i] + dy[i + h] * s[i + h],  dx[i + h] = dy[i + h] * c[i + h] - dy[i] * s[i]
// (the inverse rotation). q and k in one launch; outputs may not alias inputs.
struct RotaryParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
  void* q_out = nullptr;
  void* k_out = nullptr;
  int64_t tokens = 0;
  int q_heads = 0, k_heads = 0, head_dim = 0;
  DType dtype = DType::kBFloat16;
  bool backward = false;
};
// Largest head_dim the kernel takes (even).
int rotary_max_head_dim();
cudaError_t rotary_qk(const RotaryParams& p, cudaStream_t stream);

}  // namespace strobe::ops::cuda
