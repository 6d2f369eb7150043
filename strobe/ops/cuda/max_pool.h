// Launchers of the max-pool kernels (op strobe::max_pool2d, strobe/ops/max_pool*.cpp): raw
// pointers, sizes and a stream only, no torch header. Every launcher enqueues on `stream` and never
// syncs.
//
// Layouts: x [n, c, h, w] and y / grad_y / index [n, c, oh, ow], all either contiguous NCHW or
// channels-last NHWC (`channels_last`), as the tensors themselves. index (uint8) is the position
// of the window's maximum inside the kernel_h x kernel_w window, dy * kernel_w + dx counted from the
// padded window's top-left corner (so kernel_h * kernel_w <= 256). The rule is ATen's: the first
// maximum in row-major order, a NaN replaces the running maximum (the last NaN wins), padding never
// wins (an all -inf window picks its first in-image element).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "strobe/ops/cuda/dtype.h"

namespace strobe::ops::cuda {


struct PoolShape {
  int64_t n = 0;
  int c = 0, h = 0, w = 0, oh = 0, ow = 0;
  int kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0;
  bool channels_last = false;
};

// Whether the channels-last kernels may use 16-byte vectors: c a multiple of 16 / sizeof(element)
// and every pointer 16-byte aligned (the launchers check it and fall back to scalar accesses).
bool max_pool_vectorized(const PoolShape& s, DType dtype, const void* a, const void* b, const void* index);

// y = max over each window, index = its position (see above).
cudaError_t max_pool_fwd(const void* x, void* y, uint8_t* index, DType dtype, const PoolShape& s,
                         cudaStream_t stream);

// grad_x[i] = sum of grad_y over the outputs whose window chose element i, summed in fp32 in
// row-major output order (a gather: every grad_x element written once, no atomics, deterministic).
cudaError_t max_pool_bwd(const void* grad_y, const uint8_t* index, void* grad_x, DType dtype,
                         const PoolShape& s, cudaStream_t stream);

}  // namespace strobe::ops::cuda
