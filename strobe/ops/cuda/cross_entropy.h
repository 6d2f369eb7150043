// Launchers of the fused cross-entropy kernels (ops strobe::cross_entropy, strobe/ops/cross_entropy*.cpp,
// and strobe::linear_cross_entropy, strobe/ops/linear_cross_entropy*.cpp): raw pointers, sizes and a
// stream only, no torch header. Every launcher enqueues on `stream` and never syncs.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "strobe/ops/cuda/launchers.h"

namespace strobe::ops::cuda {

// ---- cross-entropy ------------------------------------------------------------------------------
// logits [rows, classes] contiguous (fp32, fp16, bf16), target [rows] int64. Per row:
// lse = logsumexp(logits[r]) (fp32, online max/sum in one pass) and loss = lse - logits[r][t]
// (0 for t == ignore_index; NaN for a target outside [0, classes): never a silent pass).
struct CrossEntropyFwdParams {
  const void* logits = nullptr;
  const int64_t* target = nullptr;
  float* loss = nullptr;  // [rows]
  float* lse = nullptr;  // [rows]
  int64_t rows = 0;
  int64_t classes = 0;
  int64_t ignore_index = -100;
  DType dtype = DType::kFloat32;
};
cudaError_t cross_entropy_fwd(const CrossEntropyFwdParams& p, cudaStream_t stream);

// dlogits[r][j] = (exp(logits[r][j] - lse[r]) - (j == t)) * scale, scale = grad[0] / count[0]
// (mean: count = non-ignored rows), grad[0] (sum, count null) or grad[r] (per_row); 0 for ignored
// rows. dlogits has the logits' dtype.
struct CrossEntropyBwdParams {
  const void* logits = nullptr;
  const int64_t* target = nullptr;
  const float* lse = nullptr;
  const float* grad = nullptr;
  const float* count = nullptr;
  bool per_row = false;
  void* dlogits = nullptr;
  int64_t rows = 0;
  int64_t classes = 0;
  int64_t ignore_index = -100;
  DType dtype = DType::kFloat32;
};
cudaError_t cross_entropy_bwd(const CrossEntropyBwdParams& p, cudaStream_t stream);

// One chunk of strobe::linear_cross_entropy (strobe/ops/linear_cross_entropy.cpp): logits
// [rows, classes] contiguous (fp32, fp16, bf16), target [rows] int64. One block per row, two reads of
// the row: loss[r] = lse - logits[r][t] as cross_entropy_fwd (fp32; 0 for t == ignore_index, NaN
// for a target outside [0, classes)); with `grad`, then the row overwritten in place by
// (exp(logits[r][j] - lse) - (j == t)) * inv_count[0], rounded once to the logits' dtype (0 for an
// ignored row). inv_count is one fp32 value on the device (1 / tokens not ignored): no host read.
// The block's max / sum combine in a fixed order: bitwise reproducible.
struct CrossEntropyRowsParams {
  void* logits = nullptr;
  const int64_t* target = nullptr;
  const float* inv_count = nullptr;
  float* loss = nullptr;  // [rows]
  int64_t rows = 0;
  int64_t classes = 0;
  int64_t ignore_index = -100;
  bool grad = false;
  DType dtype = DType::kFloat32;
};
cudaError_t cross_entropy_rows(const CrossEntropyRowsParams& p, cudaStream_t stream);
// y[i] = x[i] * scale[0] for n contiguous elements: x and y of one type (fp32, fp16, bf16), or x fp32
// and y fp16 / bf16; the product of the element and the fp32 scale in fp32, rounded once to y's type
// (ATen would round the scale to 16 bits first); scale is read on the device.
// linear_cross_entropy's backward: the gradients its forward made (d weight still in its fp32
// accumulator) times the incoming one, no host read.
cudaError_t scale_by_device_scalar(const void* x, DType x_dtype, void* y, DType y_dtype, int64_t n, const float* scale,
                                   cudaStream_t stream);

}  // namespace strobe::ops::cuda
