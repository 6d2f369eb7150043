// Launchers of the fused training-mode BatchNorm (+ residual add) (+ ReLU) kernels over channels-last
// activations (op strobe::batch_norm_act, strobe/ops/batch_norm_act*.cpp): raw pointers, sizes
// and a stream only, no torch header. Every launcher enqueues on `stream` and never syncs.
//
// Layout: x, residual, y, grad_y, grad_x, grad_residual are [rows, c] with c innermost (an NHWC
// tensor's memory: rows = N * H * W), c % 8 == 0, 16-byte aligned. weight, bias, running stats,
// mean, invstd, grad_weight, grad_bias: fp32 [c]. Statistics in fp32 (sums around a per-channel shift,
// per-block partials summed in a fixed order: deterministic, no atomics).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "strobe/ops/cuda/dtype.h"

namespace strobe::ops::cuda {


struct BnShape {
  int64_t rows = 0;
  int c = 0;
};

// Floats of workspace that batch_norm_act_fwd / _bwd need (per-block partials).
int64_t batch_norm_act_workspace(const BnShape& s);

// mean/invstd of every channel over the rows (biased variance), running stats updated in place
// (running = (1 - momentum) * running + momentum * stat, the variance unbiased), then
// y = act(weight * (x - mean) * invstd + bias [+ residual]) with act = ReLU when relu, else identity.
cudaError_t batch_norm_act_fwd(const void* x, const void* residual, DType dtype, const float* weight,
                               const float* bias, float* running_mean, float* running_var, float momentum,
                               float eps, bool relu, void* y, float* mean, float* invstd, float* workspace,
                               const BnShape& s, cudaStream_t stream);

// g = grad_y * (y > 0 when relu); grad_weight = sum(g * xhat), grad_bias = sum(g),
// grad_x = weight * invstd * (g - mean(g) - xhat * mean(g * xhat)), grad_residual = g (when non-null).
cudaError_t batch_norm_act_bwd(const void* grad_y, const void* y, const void* x, DType dtype,
                               const float* weight, const float* mean, const float* invstd, bool relu,
                               void* grad_x, void* grad_residual, float* grad_weight, float* grad_bias,
                               float* workspace, const BnShape& s, cudaStream_t stream);

}  // namespace strobe::ops::cuda
