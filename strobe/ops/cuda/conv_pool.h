// Launchers of the fused conv3x3 + max-pool 2x2 + ReLU kernels (op strobe::conv3x3_maxpool_relu,
// strobe/ops/conv_pool*.cpp): raw pointers, sizes and a stream only, no torch header. Every
// launcher enqueues on `stream` and never syncs.
//
// Layouts (all contiguous NCHW): x [n, cin, h, w]; weight [cout, cin, 3, 3] fp32; bias [cout] fp32;
// y / grad_y [n, cout, h/2, w/2] (floor, as MaxPool2d(2)); mask [n, cout, h/2, w/2] uint8:
// bits 0-1 the argmax of the 2x2 window (dy * 2 + dx, the first maximum in row-major order, NaN
// wins, as PyTorch's max-pool), bit 2 set when the ReLU passes the gradient (!(y <= 0)).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "strobe/ops/cuda/dtype.h"

namespace strobe::ops::cuda {


struct ConvPoolShape {
  int64_t n = 0;
  int cin = 0, cout = 0, h = 0, w = 0;
};

// y = relu(maxpool2x2(conv3x3_same(x * x_scale, weight) + bias)); accumulates in fp32.
cudaError_t conv_pool_fwd(const void* x, DType x_dtype, float x_scale, const float* weight,
                          const float* bias, void* y, DType y_dtype, uint8_t* mask,
                          const ConvPoolShape& s, cudaStream_t stream);

// grad_x = x_scale * conv_transpose(unpool(grad_y, mask)), written in gx_dtype (every element).
cudaError_t conv_pool_bwd_input(const void* grad_y, DType gy_dtype, const uint8_t* mask,
                                const float* weight, float x_scale, void* grad_x,
                                DType gx_dtype, const ConvPoolShape& s,
                                cudaStream_t stream);

// Floats of the workspace conv_pool_bwd_weight needs (per-block partial sums, reduced in a fixed
// order afterwards: deterministic, no floating-point atomics).
int64_t conv_pool_wgrad_workspace(const ConvPoolShape& s);
// grad_weight [cout, cin, 3, 3] and grad_bias [cout] (fp32, overwritten).
cudaError_t conv_pool_bwd_weight(const void* grad_y, DType gy_dtype, const uint8_t* mask,
                                 const void* x, DType x_dtype, float x_scale,
                                 float* workspace, float* grad_weight, float* grad_bias,
                                 const ConvPoolShape& s, cudaStream_t stream);

}  // namespace strobe::ops::cuda
