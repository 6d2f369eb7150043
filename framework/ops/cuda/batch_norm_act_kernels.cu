// Fused training-mode BatchNorm (+ residual) (+ ReLU) over channels-last activations (launchers in
// batch_norm_act.h). ATen runs a channels-last bf16 BatchNorm + ReLU (+ add) of ResNet-50 as up to
// seven passes over each activation (statistics, transform, ReLU forward; ReLU backward, backward
// reduce, backward element-wise, and the add); here it is four: statistics and apply forward,
// reduce and element-wise backward, with the ReLU mask read from the output and the residual's
// gradient written by the element-wise pass.
//
// Tiling of the two reductions: a block is (tile channel-vectors of 8 channels) x (lanes rows);
// a thread loads 16 bytes (bf16/fp16) or 32 bytes (fp32) per row, a warp reads whole rows
// (c <= 256) or 256 contiguous channels. Per-block partials go to a workspace and one thread per
// channel combines them in block order: deterministic, no atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "framework/ops/cuda/batch_norm_act.h"

namespace strobe::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;

template <typename T>
struct Vec8;
template <>
struct Vec8<float> {
  __device__ static void load(const float* p, float (&v)[kVec]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
  __device__ static void store(float* p, const float (&v)[kVec]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
};
template <>
struct Vec8<__nv_bfloat16> {
  __device__ static void load(const __nv_bfloat16* p, float (&v)[kVec]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
  }
  __device__ static void store(__nv_bfloat16* p, const float (&v)[kVec]) {
    uint4 raw;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
};
template <>
struct Vec8<__half> {
  __device__ static void load(const __half* p, float (&v)[kVec]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const auto* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
  }
  __device__ static void store(__half* p, const float (&v)[kVec]) {
    uint4 raw;
    auto* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
};

__device__ inline void load_f8(const float* p, float (&v)[kVec]) { Vec8<float>::load(p, v); }

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
  // about 8 blocks of 256 threads per SM on a 132-SM H100/H200, whatever the channel count
  const int64_t target = std::max<int64_t>(1, 1056 / t.grid_y);
  t.grid_x = static_cast<int>(std::max<int64_t>(1, std::min(want, target)));
  return t;
}

// Per-block Welford statistics: part_mean/part_m2 [grid_x, c], part_count [grid_x].
template <typename T>
__global__ void __launch_bounds__(kThreads) stats_kernel(const T* __restrict__ x, int64_t rows, int c, int tile,
                                                         int lanes, float* __restrict__ part_mean,
                                                         float* __restrict__ part_m2, float* __restrict__ part_count) {
  extern __shared__ float sh[];
  const int tx = threadIdx.x % tile, ty = threadIdx.x / tile;
  const int cv = blockIdx.y * tile + tx;
  const bool active = ty < lanes && cv * kVec < c;
  float mean[kVec] = {}, m2[kVec] = {};
  float n = 0.f;
  if (active) {
    for (int64_t r = static_cast<int64_t>(blockIdx.x) * lanes + ty; r < rows;
         r += static_cast<int64_t>(gridDim.x) * lanes) {
      float v[kVec];
      Vec8<T>::load(x + r * c + cv * kVec, v);
      n += 1.f;
      const float inv = 1.f / n;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float d = v[k] - mean[k];
        mean[k] += d * inv;
        m2[k] += d * (v[k] - mean[k]);
      }
    }
  }
  float* smean = sh;
  float* sm2 = sh + lanes * tile * kVec;
  float* scount = sm2 + lanes * tile * kVec;
  if (ty < lanes) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) smean[(ty * tile + tx) * kVec + k] = mean[k], sm2[(ty * tile + tx) * kVec + k] = m2[k];
    if (tx == 0) scount[ty] = n;
  }
  __syncthreads();
  if (ty != 0 || !active) return;
  float cn = scount[0];
  for (int l = 1; l < lanes; ++l) {
    const float nb = scount[l];
    if (nb == 0.f) continue;
    const float nt = cn + nb, fb = nb / nt, fab = cn * nb / nt;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float mb = smean[(l * tile + tx) * kVec + k];
      const float d = mb - mean[k];
      mean[k] += d * fb;
      m2[k] += sm2[(l * tile + tx) * kVec + k] + d * d * fab;
    }
    cn = nt;
  }
  const int64_t o = static_cast<int64_t>(blockIdx.x) * c + cv * kVec;
#pragma unroll
  for (int k = 0; k < kVec; ++k) part_mean[o + k] = mean[k], part_m2[o + k] = m2[k];
  if (blockIdx.y == 0 && tx == 0) part_count[blockIdx.x] = cn;
}

// One thread per channel: combines the partials in block order (double: cheap here), updates the
// running statistics, writes mean and invstd.
__global__ void stats_finalize_kernel(const float* __restrict__ part_mean, const float* __restrict__ part_m2,
                                      const float* __restrict__ part_count, int blocks, int c, float momentum,
                                      float eps, float* running_mean, float* running_var, float* mean_out,
                                      float* invstd_out) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  double n = 0, m = 0, m2 = 0;
  for (int b = 0; b < blocks; ++b) {
    const double nb = part_count[b];
    if (nb == 0) continue;
    const double mb = part_mean[static_cast<int64_t>(b) * c + ch], m2b = part_m2[static_cast<int64_t>(b) * c + ch];
    const double nt = n + nb, d = mb - m;
    m += d * nb / nt;
    m2 += m2b + d * d * n * nb / nt;
    n = nt;
  }
  const double var = m2 / n;
  mean_out[ch] = static_cast<float>(m);
  invstd_out[ch] = static_cast<float>(1.0 / sqrt(var + static_cast<double>(eps)));
  if (running_mean != nullptr) {
    running_mean[ch] = static_cast<float>((1.0 - momentum) * running_mean[ch] + momentum * m);
    running_var[ch] = static_cast<float>((1.0 - momentum) * running_var[ch] + momentum * (m2 / (n - 1)));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) apply_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                                         const float* __restrict__ w, const float* __restrict__ b,
                                                         const float* __restrict__ mean,
                                                         const float* __restrict__ invstd, bool relu,
                                                         T* __restrict__ y, int64_t nvec, int cvecs) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c0 = static_cast<int>(i % cvecs) * kVec;
    float v[kVec], wv[kVec], bv[kVec], mv[kVec], sv[kVec], r[kVec] = {};
    Vec8<T>::load(x + i * kVec, v);
    if (res != nullptr) Vec8<T>::load(res + i * kVec, r);
    load_f8(w + c0, wv), load_f8(b + c0, bv), load_f8(mean + c0, mv), load_f8(invstd + c0, sv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float o = (v[k] - mv[k]) * (wv[k] * sv[k]) + bv[k] + r[k];
      if (relu && o < 0.f) o = 0.f;  // NaN stays NaN, as torch.relu
      v[k] = o;
    }
    Vec8<T>::store(y + i * kVec, v);
  }
}

// g = grad_y masked by y > 0 (relu); per-block sums of g and g * xhat: part_g/part_gx [grid_x, c].
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_reduce_kernel(const T* __restrict__ gy, const T* __restrict__ y,
                                                              const T* __restrict__ x, const float* __restrict__ mean,
                                                              const float* __restrict__ invstd, bool relu,
                                                              int64_t rows, int c, int tile, int lanes,
                                                              float* __restrict__ part_g, float* __restrict__ part_gx) {
  extern __shared__ float sh[];
  const int tx = threadIdx.x % tile, ty = threadIdx.x / tile;
  const int cv = blockIdx.y * tile + tx;
  const bool active = ty < lanes && cv * kVec < c;
  float sg[kVec] = {}, sgx[kVec] = {};
  if (active) {
    float mv[kVec], sv[kVec];
    load_f8(mean + cv * kVec, mv), load_f8(invstd + cv * kVec, sv);
    for (int64_t r = static_cast<int64_t>(blockIdx.x) * lanes + ty; r < rows;
         r += static_cast<int64_t>(gridDim.x) * lanes) {
      const int64_t o = r * c + cv * kVec;
      float g[kVec], xv[kVec], yv[kVec];
      Vec8<T>::load(gy + o, g);
      Vec8<T>::load(x + o, xv);
      if (relu) Vec8<T>::load(y + o, yv);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float gk = relu && !(yv[k] > 0.f) ? 0.f : g[k];
        sg[k] += gk;
        sgx[k] += gk * (xv[k] - mv[k]) * sv[k];
      }
    }
  }
  float* s1 = sh;
  float* s2 = sh + lanes * tile * kVec;
  if (ty < lanes) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) s1[(ty * tile + tx) * kVec + k] = sg[k], s2[(ty * tile + tx) * kVec + k] = sgx[k];
  }
  __syncthreads();
  if (ty != 0 || !active) return;
  for (int l = 1; l < lanes; ++l) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) sg[k] += s1[(l * tile + tx) * kVec + k], sgx[k] += s2[(l * tile + tx) * kVec + k];
  }
  const int64_t o = static_cast<int64_t>(blockIdx.x) * c + cv * kVec;
#pragma unroll
  for (int k = 0; k < kVec; ++k) part_g[o + k] = sg[k], part_gx[o + k] = sgx[k];
}

__global__ void bwd_finalize_kernel(const float* __restrict__ part_g, const float* __restrict__ part_gx, int blocks,
                                    int c, float* grad_weight, float* grad_bias) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  float g = 0.f, gx = 0.f;
  for (int b = 0; b < blocks; ++b) g += part_g[static_cast<int64_t>(b) * c + ch], gx += part_gx[static_cast<int64_t>(b) * c + ch];
  grad_weight[ch] = gx;
  grad_bias[ch] = g;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_elemt_kernel(const T* __restrict__ gy, const T* __restrict__ y,
                                                             const T* __restrict__ x, const float* __restrict__ w,
                                                             const float* __restrict__ mean,
                                                             const float* __restrict__ invstd,
                                                             const float* __restrict__ grad_w,
                                                             const float* __restrict__ grad_b, bool relu,
                                                             float inv_rows, T* __restrict__ gx,
                                                             T* __restrict__ gres, int64_t nvec, int cvecs) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c0 = static_cast<int>(i % cvecs) * kVec;
    float g[kVec], xv[kVec], yv[kVec], wv[kVec], mv[kVec], sv[kVec], gw[kVec], gb[kVec];
    Vec8<T>::load(gy + i * kVec, g);
    Vec8<T>::load(x + i * kVec, xv);
    if (relu) Vec8<T>::load(y + i * kVec, yv);
    load_f8(w + c0, wv), load_f8(mean + c0, mv), load_f8(invstd + c0, sv), load_f8(grad_w + c0, gw),
        load_f8(grad_b + c0, gb);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (relu && !(yv[k] > 0.f)) g[k] = 0.f;
      const float xhat = (xv[k] - mv[k]) * sv[k];
      xv[k] = wv[k] * sv[k] * (g[k] - gb[k] * inv_rows - xhat * gw[k] * inv_rows);
    }
    Vec8<T>::store(gx + i * kVec, xv);
    if (gres != nullptr) Vec8<T>::store(gres + i * kVec, g);
  }
}

int elementwise_blocks(int64_t nvec) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((nvec + kThreads - 1) / kThreads, 132 * 16)));
}

template <typename T>
cudaError_t fwd_impl(const void* x, const void* residual, const float* weight, const float* bias, float* running_mean,
                     float* running_var, float momentum, float eps, bool relu, void* y, float* mean, float* invstd,
                     float* ws, const BnShape& s, cudaStream_t stream) {
  const Tiling t = tiling(s);
  float* part_mean = ws;
  float* part_m2 = ws + static_cast<int64_t>(t.grid_x) * s.c;
  float* part_count = part_m2 + static_cast<int64_t>(t.grid_x) * s.c;
  const size_t smem = (2 * static_cast<size_t>(t.lanes) * t.tile * kVec + t.lanes) * sizeof(float);
  stats_kernel<T><<<dim3(t.grid_x, t.grid_y), t.tile * t.lanes, smem, stream>>>(
      static_cast<const T*>(x), s.rows, s.c, t.tile, t.lanes, part_mean, part_m2, part_count);
  stats_finalize_kernel<<<(s.c + 127) / 128, 128, 0, stream>>>(part_mean, part_m2, part_count, t.grid_x, s.c,
                                                                 momentum, eps, running_mean, running_var, mean,
                                                                 invstd);
  const int64_t nvec = s.rows * (s.c / kVec);
  apply_kernel<T><<<elementwise_blocks(nvec), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(residual), weight, bias, mean, invstd, relu, static_cast<T*>(y),
      nvec, s.c / kVec);
  return cudaGetLastError();
}

template <typename T>
cudaError_t bwd_impl(const void* grad_y, const void* y, const void* x, const float* weight, const float* mean,
                     const float* invstd, bool relu, void* grad_x, void* grad_residual, float* grad_weight,
                     float* grad_bias, float* ws, const BnShape& s, cudaStream_t stream) {
  const Tiling t = tiling(s);
  float* part_g = ws;
  float* part_gx = ws + static_cast<int64_t>(t.grid_x) * s.c;
  const size_t smem = 2 * static_cast<size_t>(t.lanes) * t.tile * kVec * sizeof(float);
  bwd_reduce_kernel<T><<<dim3(t.grid_x, t.grid_y), t.tile * t.lanes, smem, stream>>>(
      static_cast<const T*>(grad_y), static_cast<const T*>(y), static_cast<const T*>(x), mean, invstd, relu, s.rows,
      s.c, t.tile, t.lanes, part_g, part_gx);
  bwd_finalize_kernel<<<(s.c + 127) / 128, 128, 0, stream>>>(part_g, part_gx, t.grid_x, s.c, grad_weight, grad_bias);
  const int64_t nvec = s.rows * (s.c / kVec);
  bwd_elemt_kernel<T><<<elementwise_blocks(nvec), kThreads, 0, stream>>>(
      static_cast<const T*>(grad_y), static_cast<const T*>(y), static_cast<const T*>(x), weight, mean, invstd,
      grad_weight, grad_bias, relu, 1.f / static_cast<float>(s.rows), static_cast<T*>(grad_x),
      static_cast<T*>(grad_residual), nvec, s.c / kVec);
  return cudaGetLastError();
}

}  // namespace

int64_t batch_norm_act_workspace(const BnShape& s) {
  const Tiling t = tiling(s);
  return static_cast<int64_t>(t.grid_x) * (2 * static_cast<int64_t>(s.c) + 1);
}

cudaError_t batch_norm_act_fwd(const void* x, const void* residual, BnDType dtype, const float* weight,
                               const float* bias, float* running_mean, float* running_var, float momentum,
                               float eps, bool relu, void* y, float* mean, float* invstd, float* workspace,
                               const BnShape& s, cudaStream_t stream) {
  if (s.rows < 1 || s.c < kVec || s.c % kVec != 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case BnDType::kFloat32:
      return fwd_impl<float>(x, residual, weight, bias, running_mean, running_var, momentum, eps, relu, y, mean,
                             invstd, workspace, s, stream);
    case BnDType::kBFloat16:
      return fwd_impl<__nv_bfloat16>(x, residual, weight, bias, running_mean, running_var, momentum, eps, relu, y,
                                     mean, invstd, workspace, s, stream);
    case BnDType::kFloat16:
      return fwd_impl<__half>(x, residual, weight, bias, running_mean, running_var, momentum, eps, relu, y, mean,
                              invstd, workspace, s, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t batch_norm_act_bwd(const void* grad_y, const void* y, const void* x, BnDType dtype, const float* weight,
                               const float* mean, const float* invstd, bool relu, void* grad_x, void* grad_residual,
                               float* grad_weight, float* grad_bias, float* workspace, const BnShape& s,
                               cudaStream_t stream) {
  if (s.rows < 1 || s.c < kVec || s.c % kVec != 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case BnDType::kFloat32:
      return bwd_impl<float>(grad_y, y, x, weight, mean, invstd, relu, grad_x, grad_residual, grad_weight, grad_bias,
                             workspace, s, stream);
    case BnDType::kBFloat16:
      return bwd_impl<__nv_bfloat16>(grad_y, y, x, weight, mean, invstd, relu, grad_x, grad_residual, grad_weight,
                                     grad_bias, workspace, s, stream);
    case BnDType::kFloat16:
      return bwd_impl<__half>(grad_y, y, x, weight, mean, invstd, relu, grad_x, grad_residual, grad_weight,
                              grad_bias, workspace, s, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace strobe::ops::cuda
