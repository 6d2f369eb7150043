// Launchers of the fused residual-add + LayerNorm / RMSNorm kernels (ops strobe::add_layer_norm and
// strobe::add_rms_norm, strobe/ops/add_layer_norm*.cpp, add_rms_norm.cpp): raw pointers, sizes and a
// stream only, no torch header. Every launcher enqueues on `stream` and never syncs.
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
  // Also max |y| (one fp32 on the device, zeroed by the launcher, NaN when y holds one): the amax of a
  // float8 quantization of y (add_layer_norm_amax, add_rms_norm_amax); null: not computed.
  float* y_amax = nullptr;
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

}  // namespace strobe::ops::cuda
