// Launchers of the SwiGLU kernels (op strobe::swiglu, strobe/ops/swiglu*.cpp): raw pointers, sizes
// and a stream only, no torch header. Enqueue on `stream`, never sync.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "strobe/ops/cuda/dtype.h"

namespace strobe::ops::cuda {

// gu [rows, 2 * cols] (gate in the first cols, up in the last), y / dy [rows, cols], dgu like gu, all
// contiguous, of `dtype` (fp32, fp16, bf16); fp32 arithmetic rounded to dtype where ATen's
// silu(gate) * up and its autograd backward round:
//   forward:  s = dtype(g / (1 + exp(-g))), y = dtype(s * u)
//   backward: ds = dtype(dy * u), du = dtype(dy * s),
//             dg = dtype(ds * sig * (1 + g * (1 - sig))), sig = 1 / (1 + exp(-g))
// amax, when not null, is a device float the launcher sets to max |output| over the rounded outputs (y,
// or d gate_up), NaN when one is NaN: the amax of a float8 quantization of the output (fp8.h).
cudaError_t swiglu_fwd(const void* gu, void* y, int64_t rows, int64_t cols, DType dtype, float* amax,
                       cudaStream_t stream);
cudaError_t swiglu_bwd(const void* dy, const void* gu, void* dgu, int64_t rows, int64_t cols, DType dtype,
                       float* amax, cudaStream_t stream);

}  // namespace strobe::ops::cuda
