// Launchers of the fused residual-add + LayerNorm / RMSNorm kernels (ops strobe::add_layer_norm and
// strobe::add_rms_norm, strobe/ops/add_layer_norm*.cpp, add_rms_norm.cpp) and the fused cross-entropy kernels (op strobe::cross_entropy,
// strobe/ops/cross_entropy*.cpp): raw pointers, sizes and a stream only, no torch header. Every
// launcher enqueues on `stream` and never syncs.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "strobe/ops/cuda/launchers.h"

namespace strobe::ops::cuda {

// ---- add + LayerNorm ----------------------------------------------------------------------------
// Rows of `cols` contiguous elements. x, delta, sum, y, dy, dsum, dx share `dtype` (fp32, fp16,
// bf16); weight / bias have `param_dtype` (fp32, fp16, bf16). Statistics and gradients of the
// parameters are fp32. Accumulation in fp32.
struct LayerNormFwdParams {
  const void* x = nullptr;
  const void* delta = nullptr;  // null: plain LayerNorm of x
  const void* weight = nullptr;
  const void* bias = nullptr;  // null: no shift
  void* sum = nullptr;  // x + delta rounded to dtype (written only when delta != null)
  void* y = nullptr;
  float* mean = nullptr;  // [rows]
  float* rstd = nullptr;  // [rows] 1 / sqrt(var + eps), biased variance
  int64_t rows = 0;
  int cols = 0;
  float eps = 1e-5f;
  DType dtype = DType::kFloat32;
  DType param_dtype = DType::kFloat32;
  // RMSNorm (op strobe::add_rms_norm) in Hugging Face's numerics: rstd = 1 / sqrt(mean(sum^2) + eps),
  // y = T(T(sum * rstd) * weight) (two roundings); no centring, no bias, mean may be null.
  bool rms = false;
};

// Largest `cols` the kernels take (each thread holds at most 4 scalars or one 16-byte vector of
// the row in registers, 1024 threads per row).
int layer_norm_max_cols();
cudaError_t layer_norm_fwd(const LayerNormFwdParams& p, cudaStream_t stream);

struct LayerNormBwdParams {
  const void* dy = nullptr;
  const void* dsum = nullptr;  // null: no gradient through the residual output
  const void* sum = nullptr;  // the normalised input (x + delta, or x)
  const float* mean = nullptr;
  const float* rstd = nullptr;
  const void* weight = nullptr;
  void* dx = nullptr;  // dsum + d LN / d sum, in dtype
  float* dweight = nullptr;  // [cols]
  float* dbias = nullptr;  // [cols] or null
  float* workspace = nullptr;  // layer_norm_bwd_workspace() floats
  int64_t rows = 0;
  int cols = 0;
  DType dtype = DType::kFloat32;
  DType param_dtype = DType::kFloat32;
  // RMSNorm's backward: dx = dsum + rstd * (g - xhat * mean(g * xhat)), g = dy * weight,
  // xhat = sum * rstd; dweight = sum over rows of dy * T(xhat); mean and dbias unused.
  bool rms = false;
};
// Floats of workspace the backward needs: per-block partial sums of dweight / dbias, reduced in a
// fixed order by a second kernel (deterministic, no floating-point atomics). The number of blocks
// depends only on (rows, cols, dtype), so results are bitwise reproducible.
int64_t layer_norm_bwd_workspace(int64_t rows, int cols, DType dtype);
cudaError_t layer_norm_bwd(const LayerNormBwdParams& p, cudaStream_t stream);

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
