// Launchers of the float8 quantization kernels (op strobe::fp8_quantize, strobe/ops/fp8*.cpp): raw
// pointers, sizes and a stream only, no torch header. Enqueue on `stream`, never sync.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "strobe/ops/cuda/dtype.h"

namespace strobe::ops::cuda {

// The two float8 formats of Hopper's tensor cores: e4m3 (finite only, max 448) for weights and
// activations, e5m2 (max 57344) for gradients.
enum class Fp8Format : uint8_t { kE4M3 = 0, kE5M2 = 1 };

// Tensorwise dynamic scaling, two launches, no host read:
//   amax      = max |x| over the whole tensor, fp32; NaN when any element is NaN
//   scale     = fp8_max / max(amax, 1e-12)   (fp32 division; a NaN amax stays NaN)
//   q         = saturate(fp32(x) * scale) rounded to nearest even in `format`, NaN kept
//   q_t       = q transposed ([cols, rows], contiguous), when q_t is not null
//   scale_inv = 1 / scale (fp32): the dequantization scale cuBLASLt's scaled GEMM takes
// x [rows, cols] contiguous, of `dtype` (fp32, fp16, bf16); q, q_t one byte per element; amax a
// device float: the launcher's workspace, overwritten, or with amax_given the max |x| a producer
// wrote (only read: the amax pass is skipped); scale_inv one device float.
// col_sums (fp32 [cols], or null): also the sums of x's columns in fp32, from the cast's read where the
// cast runs in tiles (the bias gradient of a float8 linear); col_work then holds the
// fp8_col_work_floats(x, rows, cols, q_t != null) floats the tiles' partial sums take (null when 0).
cudaError_t fp8_quantize(const void* x, int64_t rows, int64_t cols, DType dtype, Fp8Format format, void* q, void* q_t,
                         float* amax, bool amax_given, float* scale_inv, float* col_sums, float* col_work,
                         cudaStream_t stream);
int64_t fp8_col_work_floats(const void* x, int64_t rows, int64_t cols, bool transpose);

}  // namespace strobe::ops::cuda
