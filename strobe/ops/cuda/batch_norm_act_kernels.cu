// Fused training-mode BatchNorm (+ residual) (+ ReLU) over channels-last activations (launchers in
// batch_norm_act.h). ATen runs a channels-last bf16 BatchNorm + ReLU (+ add) of ResNet-50 as up to
// seven passes over each activation (statistics, transform, ReLU forward; ReLU backward, backward
// reduce, backward element-wise, and the add); here it is four: statistics and apply forward,
// reduce and element-wise backward, with the ReLU mask read from the output and the residual's
// gradient written by the element-wise pass.
//
// v2 (v1 combined ~1000 per-block Welford partials in one serial thread per channel, which was
// latency-bound and made ResNet-50 slower than ATen): every pass uses one tiling, (tile channel
// vectors of 8 channels) x (lanes rows) per block over a contiguous share of rows, ~2 waves of
// blocks; statistics are fp32 sums around a per-channel shift (the channel's value in row 0);
// a 256-thread finalize per 32 channels sums the partials in a fixed order (deterministic, no
// atomics) and folds everything per-channel into coefficients that the element-wise passes keep
// in registers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "strobe/ops/cuda/batch_norm_act.h"
#include "strobe/ops/cuda/common.cuh"

namespace strobe::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;

__device__ inline void load_f8(const float* p, float (&v)[kVec]) { Vec8<float>::load(p, v); }

// All four passes share one tiling: a block is (tile channel-vectors of 8 channels) x (lanes rows);
// thread (tx, ty) keeps channel vector blockIdx.y * tile + tx and walks rows ty + lanes * k of its
// block's share, so per-channel coefficients are loaded once into registers.
struct Tiling {
  int tile = 1, lanes = 1, grid_x = 1, grid_y = 1;
};

Tiling tiling(const BnShape& s) {
  Tiling t;
  const int cvecs = s.c / kVec;
  t.tile = std::min(cvecs, 32);
  t.lanes = kThreads / t.tile;
  t.grid_y = (cvecs + t.tile - 1) / t.tile;
  const int64_t want = (s.rows + t.lanes - 1) / t.lanes;
  // about 2 waves of 256-thread blocks on a 132-SM H100/H200: few partials to combine
  const int64_t target = std::max<int64_t>(1, 528 / t.grid_y);
  t.grid_x = static_cast<int>(std::max<int64_t>(1, std::min(want, target)));
  return t;
}

// Row range of block bx: contiguous rows, so a warp's loads stay within a few rows.
__device__ inline void block_rows(int64_t rows, int64_t* begin, int64_t* end) {
  const int64_t per = (rows + gridDim.x - 1) / gridDim.x;
  *begin = static_cast<int64_t>(blockIdx.x) * per;
  *end = min(rows, *begin + per);
}

// Per-block sums (fwd: of x - K and (x - K)^2 with K = x[row 0] per channel, a shift that keeps the
// fp32 variance free of cancellation; bwd: of g and g * xhat). part_a/part_b [grid_x, c].
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads) reduce_kernel(const T* __restrict__ x, const T* __restrict__ gy,
                                                          const T* __restrict__ y, const float* __restrict__ mean,
                                                          const float* __restrict__ invstd, bool relu, int64_t rows,
                                                          int c, int tile, int lanes, float* __restrict__ part_a,
                                                          float* __restrict__ part_b) {
  extern __shared__ float sh[];
  const int tx = threadIdx.x % tile, ty = threadIdx.x / tile;
  const int cv = blockIdx.y * tile + tx;
  const bool active = ty < lanes && cv * kVec < c;
  float sa[kVec] = {}, sb[kVec] = {};
  if (active) {
    float k0[kVec], k1[kVec];
    if constexpr (kBackward) {
      load_f8(mean + cv * kVec, k0), load_f8(invstd + cv * kVec, k1);
    } else {
      Vec8<T>::load(x + cv * kVec, k0);  // the shift: row 0
    }
    int64_t begin, end;
    block_rows(rows, &begin, &end);
    for (int64_t r = begin + ty; r < end; r += lanes) {
      const int64_t o = r * c + cv * kVec;
      float xv[kVec];
      Vec8<T>::load(x + o, xv);
      if constexpr (kBackward) {
        float g[kVec], yv[kVec];
        Vec8<T>::load(gy + o, g);
        if (relu) Vec8<T>::load(y + o, yv);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float gk = relu && !(yv[k] > 0.f) ? 0.f : g[k];
          sa[k] += gk;
          sb[k] += gk * (xv[k] - k0[k]) * k1[k];
        }
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float d = xv[k] - k0[k];
          sa[k] += d;
          sb[k] += d * d;
        }
      }
    }
  }
  float* s1 = sh;
  float* s2 = sh + lanes * tile * kVec;
  if (ty < lanes) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) s1[(ty * tile + tx) * kVec + k] = sa[k], s2[(ty * tile + tx) * kVec + k] = sb[k];
  }
  __syncthreads();
  if (ty != 0 || !active) return;
  for (int l = 1; l < lanes; ++l) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) sa[k] += s1[(l * tile + tx) * kVec + k], sb[k] += s2[(l * tile + tx) * kVec + k];
  }
  const int64_t o = static_cast<int64_t>(blockIdx.x) * c + cv * kVec;
#pragma unroll
  for (int k = 0; k < kVec; ++k) part_a[o + k] = sa[k], part_b[o + k] = sb[k];
}

// Sums the partials of 32 channels per block: 8 row groups of 32 threads, then shared memory; fixed
// order. fwd: mean, invstd, running stats and coef = scale = weight * invstd;
// bwd: grad_weight, grad_bias and coef = (ga, c1, c2) of grad_x = ga * g - c1 - c2 * (x - mean).
template <bool kBackward>
__global__ void finalize_kernel(const float* __restrict__ part_a, const float* __restrict__ part_b, int blocks, int c,
                                int64_t rows, const float* __restrict__ shift_src, DType dtype,
                                const float* __restrict__ weight, const float* __restrict__ bias, float momentum,
                                float eps, float* running_mean, float* running_var, float* mean, float* invstd,
                                float* grad_weight, float* grad_bias, float* coef) {
  __shared__ float sa[8][33], sb[8][33];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int ch = blockIdx.x * 32 + tx;
  float a = 0.f, b = 0.f;
  if (ch < c) {
    for (int blk = ty; blk < blocks; blk += 8) {
      a += part_a[static_cast<int64_t>(blk) * c + ch];
      b += part_b[static_cast<int64_t>(blk) * c + ch];
    }
  }
  sa[ty][tx] = a, sb[ty][tx] = b;
  __syncthreads();
  if (ty != 0 || ch >= c) return;
  a = 0.f, b = 0.f;
  for (int l = 0; l < 8; ++l) a += sa[l][tx], b += sb[l][tx];
  const double n = static_cast<double>(rows);
  if constexpr (!kBackward) {
    (void)grad_weight, (void)grad_bias;
    float k;  // the shift the sums were taken around: x[row 0, ch]
    if (dtype == DType::kFloat32) {
      k = reinterpret_cast<const float*>(shift_src)[ch];
    } else if (dtype == DType::kBFloat16) {
      k = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(shift_src)[ch]);
    } else {
      k = __half2float(reinterpret_cast<const __half*>(shift_src)[ch]);
    }
    const double m1 = a / n;
    double var = b / n - m1 * m1;
    if (var < 0.0) var = 0.0;  // rounding; NaN stays NaN (fmax would drop it)
    const double m = k + m1;
    const float is = static_cast<float>(1.0 / sqrt(var + static_cast<double>(eps)));
    mean[ch] = static_cast<float>(m);
    invstd[ch] = is;
    running_mean[ch] = static_cast<float>((1.0 - momentum) * running_mean[ch] + momentum * m);
    running_var[ch] = static_cast<float>((1.0 - momentum) * running_var[ch] + momentum * var * n / (n - 1.0));
    coef[ch] = weight[ch] * is;  // y = (x - mean) * coef0 + bias: no cancellation against a large mean
  } else {
    (void)shift_src, (void)dtype, (void)bias, (void)momentum, (void)eps, (void)running_mean, (void)running_var;
    grad_weight[ch] = b;
    grad_bias[ch] = a;
    // grad_x = ga * g - c1 - c2 * (x - mean) (the xhat form: no cancellation against a large mean)
    const float is = invstd[ch], ga = weight[ch] * is;
    coef[ch] = ga;
    coef[c + ch] = ga * a / static_cast<float>(n);
    coef[2 * c + ch] = ga * is * b / static_cast<float>(n);
  }
}

// fwd: y = act((x - mean) * scale + bias [+ residual]).
template <typename T>
__global__ void __launch_bounds__(kThreads) apply_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                                         const float* __restrict__ coef, const float* __restrict__ mean,
                                                         const float* __restrict__ bias, bool relu, T* __restrict__ y,
                                                         int64_t rows, int c, int tile, int lanes) {
  const int tx = threadIdx.x % tile, ty = threadIdx.x / tile;
  const int cv = blockIdx.y * tile + tx;
  if (ty >= lanes || cv * kVec >= c) return;
  float sc[kVec], sf[kVec], mv[kVec];
  load_f8(coef + cv * kVec, sc), load_f8(bias + cv * kVec, sf), load_f8(mean + cv * kVec, mv);
  int64_t begin, end;
  block_rows(rows, &begin, &end);
  for (int64_t r = begin + ty; r < end; r += lanes) {
    const int64_t o = r * c + cv * kVec;
    float v[kVec], rv[kVec] = {};
    Vec8<T>::load(x + o, v);
    if (res != nullptr) Vec8<T>::load(res + o, rv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float z = (v[k] - mv[k]) * sc[k] + sf[k] + rv[k];
      if (relu && z < 0.f) z = 0.f;  // NaN stays NaN, as torch.relu
      v[k] = z;
    }
    Vec8<T>::store(y + o, v);
  }
}

// bwd: g = grad_y masked by y > 0 (relu); grad_x = ga * g - c1 - c2 * (x - mean); grad_residual = g.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_elemt_kernel(const T* __restrict__ gy, const T* __restrict__ y,
                                                             const T* __restrict__ x, const float* __restrict__ coef,
                                                             const float* __restrict__ mean, bool relu, T* __restrict__ gx, T* __restrict__ gres,
                                                             int64_t rows, int c, int tile, int lanes) {
  const int tx = threadIdx.x % tile, ty = threadIdx.x / tile;
  const int cv = blockIdx.y * tile + tx;
  if (ty >= lanes || cv * kVec >= c) return;
  float ca[kVec], c1[kVec], c2[kVec], mv[kVec];
  load_f8(coef + cv * kVec, ca), load_f8(coef + c + cv * kVec, c1), load_f8(coef + 2 * c + cv * kVec, c2);
  load_f8(mean + cv * kVec, mv);
  int64_t begin, end;
  block_rows(rows, &begin, &end);
  for (int64_t r = begin + ty; r < end; r += lanes) {
    const int64_t o = r * c + cv * kVec;
    float g[kVec], xv[kVec], yv[kVec];
    Vec8<T>::load(gy + o, g);
    Vec8<T>::load(x + o, xv);
    if (relu) Vec8<T>::load(y + o, yv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (relu && !(yv[k] > 0.f)) g[k] = 0.f;
      xv[k] = ca[k] * g[k] - c1[k] - c2[k] * (xv[k] - mv[k]);
    }
    Vec8<T>::store(gx + o, xv);
    if (gres != nullptr) Vec8<T>::store(gres + o, g);
  }
}

// Workspace layout (floats): part_a [grid_x * c], part_b [grid_x * c], coef [3 * c].
int64_t workspace_floats(const Tiling& t, const BnShape& s) {
  return 2 * static_cast<int64_t>(t.grid_x) * s.c + 3 * static_cast<int64_t>(s.c);
}

template <typename T>
cudaError_t fwd_impl(const void* x, const void* residual, DType dtype, const float* weight, const float* bias,
                     float* running_mean, float* running_var, float momentum, float eps, bool relu, void* y,
                     float* mean, float* invstd, float* ws, const BnShape& s, cudaStream_t stream) {
  const Tiling t = tiling(s);
  float* part_a = ws;
  float* part_b = ws + static_cast<int64_t>(t.grid_x) * s.c;
  float* coef = part_b + static_cast<int64_t>(t.grid_x) * s.c;
  const size_t smem = 2 * static_cast<size_t>(t.lanes) * t.tile * kVec * sizeof(float);
  const dim3 grid(t.grid_x, t.grid_y);
  const T* xt = static_cast<const T*>(x);
  reduce_kernel<T, false><<<grid, t.tile * t.lanes, smem, stream>>>(xt, nullptr, nullptr, nullptr, nullptr, false,
                                                                     s.rows, s.c, t.tile, t.lanes, part_a, part_b);
  finalize_kernel<false><<<(s.c + 31) / 32, 256, 0, stream>>>(part_a, part_b, t.grid_x, s.c, s.rows,
                                                               reinterpret_cast<const float*>(x), dtype, weight, bias,
                                                               momentum, eps, running_mean, running_var, mean, invstd,
                                                               nullptr, nullptr, coef);
  apply_kernel<T><<<grid, t.tile * t.lanes, 0, stream>>>(xt, static_cast<const T*>(residual), coef, mean, bias, relu,
                                                          static_cast<T*>(y), s.rows, s.c, t.tile, t.lanes);
  return cudaGetLastError();
}

template <typename T>
cudaError_t bwd_impl(const void* grad_y, const void* y, const void* x, const float* weight, const float* mean,
                     const float* invstd, bool relu, void* grad_x, void* grad_residual, float* grad_weight,
                     float* grad_bias, float* ws, const BnShape& s, cudaStream_t stream) {
  const Tiling t = tiling(s);
  float* part_a = ws;
  float* part_b = ws + static_cast<int64_t>(t.grid_x) * s.c;
  float* coef = part_b + static_cast<int64_t>(t.grid_x) * s.c;
  const size_t smem = 2 * static_cast<size_t>(t.lanes) * t.tile * kVec * sizeof(float);
  const dim3 grid(t.grid_x, t.grid_y);
  const T* gyt = static_cast<const T*>(grad_y);
  const T* yt = static_cast<const T*>(y);
  const T* xt = static_cast<const T*>(x);
  reduce_kernel<T, true><<<grid, t.tile * t.lanes, smem, stream>>>(xt, gyt, yt, mean, invstd, relu, s.rows, s.c,
                                                                    t.tile, t.lanes, part_a, part_b);
  finalize_kernel<true><<<(s.c + 31) / 32, 256, 0, stream>>>(part_a, part_b, t.grid_x, s.c, s.rows, nullptr,
                                                             DType::kFloat32, weight, nullptr, 0.f, 0.f, nullptr,
                                                             nullptr, const_cast<float*>(mean),
                                                             const_cast<float*>(invstd), grad_weight, grad_bias, coef);
  bwd_elemt_kernel<T><<<grid, t.tile * t.lanes, 0, stream>>>(gyt, yt, xt, coef, mean, relu, static_cast<T*>(grad_x),
                                                              static_cast<T*>(grad_residual), s.rows, s.c, t.tile,
                                                              t.lanes);
  return cudaGetLastError();
}

}  // namespace

int64_t batch_norm_act_workspace(const BnShape& s) { return workspace_floats(tiling(s), s); }

cudaError_t batch_norm_act_fwd(const void* x, const void* residual, DType dtype, const float* weight,
                               const float* bias, float* running_mean, float* running_var, float momentum,
                               float eps, bool relu, void* y, float* mean, float* invstd, float* workspace,
                               const BnShape& s, cudaStream_t stream) {
  if (s.rows < 1 || s.c < kVec || s.c % kVec != 0) return cudaErrorInvalidValue;
  return dispatch_float(dtype, [&](auto t) {
    return fwd_impl<typename decltype(t)::type>(x, residual, dtype, weight, bias, running_mean, running_var, momentum, eps,
                                                relu, y, mean, invstd, workspace, s, stream);
  });
}

cudaError_t batch_norm_act_bwd(const void* grad_y, const void* y, const void* x, DType dtype, const float* weight,
                               const float* mean, const float* invstd, bool relu, void* grad_x, void* grad_residual,
                               float* grad_weight, float* grad_bias, float* workspace, const BnShape& s,
                               cudaStream_t stream) {
  if (s.rows < 1 || s.c < kVec || s.c % kVec != 0) return cudaErrorInvalidValue;
  return dispatch_float(dtype, [&](auto t) {
    return bwd_impl<typename decltype(t)::type>(grad_y, y, x, weight, mean, invstd, relu, grad_x, grad_residual,
                                                grad_weight, grad_bias, workspace, s, stream);
  });
}

}  // namespace strobe::ops::cuda
