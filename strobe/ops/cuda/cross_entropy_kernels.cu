// Fused cross-entropy (forward, backward) and the row kernel of linear_cross_entropy's chunks.
// Memory-bound kernels: one warp per row; forward is an online logsumexp (one read of the logits),
// backward one read and one write of the logits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "strobe/ops/cuda/common.cuh"
#include "strobe/ops/cuda/cross_entropy.h"

namespace strobe::ops::cuda {
namespace {

// ---- cross-entropy ------------------------------------------------------------------------------
constexpr int kCeRowsPerBlock = 8;  // one warp per row

// (m, s) += (m2, s2) for online log-sum-exp pairs (s = sum of exp(x - m)); NaN wins; a side that saw
// nothing (m = -inf, s = 0) adds nothing.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float mm = (m2 > m || m2 != m2) ? m2 : m;
  const float t1 = m == -INFINITY ? 0.f : s * expf(m - mm);
  const float t2 = m2 == -INFINITY ? 0.f : s2 * expf(m2 - mm);
  m = mm;
  s = t1 + t2;
}

template <typename T>
__global__ void __launch_bounds__(256) ce_fwd_kernel(CrossEntropyFwdParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCeRowsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= p.rows) return;
  const T* x = static_cast<const T*>(p.logits) + row * p.classes;
  // Online logsumexp per lane: m = running max, s = sum of exp(x - m). NaN propagates (fmaxf would
  // drop it, so the max is taken with a comparison that keeps NaN).
  float m = -INFINITY, s = 0.f;
  for (int64_t j = lane; j < p.classes; j += 32) {
    const float v = to_f(x[j]);
    if (v > m || v != v) {
      s = s * expf(m - v) + 1.f;
      m = v;
    } else {
      s += expf(v - m);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    // A lane that saw nothing has m = -inf, s = 0: its term vanishes (guard -inf - -inf = NaN).
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
  }
  const float lse = m + logf(s);
  if (lane == 0) {
    const int64_t t = p.target[row];
    float loss;
    if (t == p.ignore_index) loss = 0.f;
    else if (t < 0 || t >= p.classes) loss = NAN;
    else loss = lse - to_f(x[t]);
    p.loss[row] = loss;
    p.lse[row] = lse;
  }
}

template <typename T>
__global__ void __launch_bounds__(256) ce_bwd_kernel(CrossEntropyBwdParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCeRowsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= p.rows) return;
  const T* x = static_cast<const T*>(p.logits) + row * p.classes;
  T* dx = static_cast<T*>(p.dlogits) + row * p.classes;
  const int64_t t = p.target[row];
  if (t == p.ignore_index) {
    for (int64_t j = lane; j < p.classes; j += 32) dx[j] = from_f<T>(0.f);
    return;
  }
  float scale = p.per_row ? p.grad[row] : p.grad[0];
  if (p.count) scale /= p.count[0];
  // An out-of-range target gave a NaN loss; its gradient is NaN too.
  if (t < 0 || t >= p.classes) scale = NAN;
  const float lse = p.lse[row];
  for (int64_t j = lane; j < p.classes; j += 32) {
    const float pr = expf(to_f(x[j]) - lse);
    dx[j] = from_f<T>((pr - (j == t ? 1.f : 0.f)) * scale);
  }
}

// ---- one chunk of linear_cross_entropy: loss and softmax - onehot in place, one block per row -----
constexpr int kCeRowThreads = 512;

template <typename T, int VEC>
__global__ void __launch_bounds__(kCeRowThreads) ce_rows_kernel(CrossEntropyRowsParams p) {
  __shared__ float sh_m[kCeRowThreads / 32], sh_s[kCeRowThreads / 32];
  __shared__ float sh_lse;
  const int64_t row = blockIdx.x;
  T* x = static_cast<T*>(p.logits) + row * p.classes;
  const int64_t t = p.target[row];
  const bool ignored = t == p.ignore_index, bad = !ignored && (t < 0 || t >= p.classes);
  // The target's logit, read before any thread overwrites the row.
  const float xt = (threadIdx.x == 0 && !ignored && !bad) ? to_f(x[t]) : 0.f;
  // Pass 1: per thread, online max / sum of exp over its vectors (one rescale per vector).
  float m = -INFINITY, s = 0.f;
  const int64_t nvec = p.classes / VEC;
  for (int64_t i = threadIdx.x; i < nvec; i += kCeRowThreads) {
    const Pack<T, VEC> v = reinterpret_cast<const Pack<T, VEC>*>(x)[i];
    float f[VEC], vm = -INFINITY;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      f[j] = to_f(v.v[j]);
      vm = (f[j] > vm || f[j] != f[j]) ? f[j] : vm;
    }
    float vs = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) vs += expf(f[j] - vm);
    lse_merge(m, s, vm, vs);
  }
  // Butterfly over the warp, then warp 0 over the warps' pairs in warp order.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh_m[warp] = m, sh_s[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = sh_m[0], bs = sh_s[0];
    for (int w = 1; w < kCeRowThreads / 32; ++w) lse_merge(bm, bs, sh_m[w], sh_s[w]);
    const float lse = bm + logf(bs);
    sh_lse = lse;
    p.loss[row] = ignored ? 0.f : bad ? NAN : lse - xt;
  }
  if (!p.grad) return;
  __syncthreads();
  const float lse = sh_lse;
  // Pass 2: the row becomes (softmax - onehot) * inv_count, rounded once.
  const float scale = ignored ? 0.f : bad ? NAN : p.inv_count[0];
  for (int64_t i = threadIdx.x; i < nvec; i += kCeRowThreads) {
    Pack<T, VEC> v = reinterpret_cast<const Pack<T, VEC>*>(x)[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const int64_t col = i * VEC + j;
      const float pr = ignored ? 0.f : expf(to_f(v.v[j]) - lse);
      v.v[j] = from_f<T>((pr - (col == t ? 1.f : 0.f)) * scale);
    }
    reinterpret_cast<Pack<T, VEC>*>(x)[i] = v;
  }
}

template <typename T>
cudaError_t launch_ce_rows(const CrossEntropyRowsParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = p.classes % kVec == 0 && reinterpret_cast<uintptr_t>(p.logits) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (vec) ce_rows_kernel<T, kVec><<<grid, kCeRowThreads, 0, stream>>>(p);
  else ce_rows_kernel<T, 1><<<grid, kCeRowThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// y = x * scale[0], the product in fp32 rounded once to y's type (x: the same type, or the fp32
// accumulator of a 16-bit gradient). VEC elements per item: 16 bytes of the narrower type.
template <typename Tin, typename Tout, int VEC>
__global__ void __launch_bounds__(256) scale_kernel(const Tin* __restrict__ x, Tout* __restrict__ y, int64_t n,
                                                    const float* __restrict__ scale) {
  const float a = scale[0];
  const int64_t nvec = n / VEC;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x; i < nvec; i += static_cast<int64_t>(gridDim.x) * 256) {
    const Pack<Tin, VEC> v = reinterpret_cast<const Pack<Tin, VEC>*>(x)[i];
    Pack<Tout, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = from_f<Tout>(__fmul_rn(to_f(v.v[j]), a));
    reinterpret_cast<Pack<Tout, VEC>*>(y)[i] = o;
  }
  // The tail of a length that is not a multiple of VEC (VEC > 1 only when both pointers are aligned).
  for (int64_t i = nvec * VEC + static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * 256)
    y[i] = from_f<Tout>(__fmul_rn(to_f(x[i]), a));
}

template <typename Tin, typename Tout>
cudaError_t launch_scale(const void* x, void* y, int64_t n, const float* scale, cudaStream_t stream) {
  constexpr int kVec = 16 / (sizeof(Tin) < sizeof(Tout) ? sizeof(Tin) : sizeof(Tout));
  const bool vec = reinterpret_cast<uintptr_t>(x) % (sizeof(Tin) * kVec) == 0 &&
                   reinterpret_cast<uintptr_t>(y) % (sizeof(Tout) * kVec) == 0;
  const int64_t items = vec ? std::max<int64_t>(1, n / kVec) : n;
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((items + 255) / 256, 132 * 16)));
  if (vec) scale_kernel<Tin, Tout, kVec><<<grid, 256, 0, stream>>>(static_cast<const Tin*>(x), static_cast<Tout*>(y), n, scale);
  else scale_kernel<Tin, Tout, 1><<<grid, 256, 0, stream>>>(static_cast<const Tin*>(x), static_cast<Tout*>(y), n, scale);
  return cudaGetLastError();
}

template <typename P>
dim3 ce_grid(const P& p) {
  return dim3(static_cast<unsigned>((p.rows + kCeRowsPerBlock - 1) / kCeRowsPerBlock));
}

}  // namespace

cudaError_t cross_entropy_fwd(const CrossEntropyFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  return dispatch_float(p.dtype, [&](auto t) {
    ce_fwd_kernel<typename decltype(t)::type><<<ce_grid(p), 256, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t cross_entropy_bwd(const CrossEntropyBwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  return dispatch_float(p.dtype, [&](auto t) {
    ce_bwd_kernel<typename decltype(t)::type><<<ce_grid(p), 256, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t cross_entropy_rows(const CrossEntropyRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  return dispatch_float(p.dtype, [&](auto t) { return launch_ce_rows<typename decltype(t)::type>(p, stream); });
}

cudaError_t scale_by_device_scalar(const void* x, DType x_dtype, void* y, DType y_dtype, int64_t n, const float* scale,
                                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  // x and y of one type, or fp32 x scaled into a 16-bit y.
  if (x_dtype != y_dtype && x_dtype != DType::kFloat32) return cudaErrorInvalidValue;
  return dispatch_float(x_dtype, [&](auto tx) {
    return dispatch_float(y_dtype, [&](auto ty) {
      using X = typename decltype(tx)::type;
      using Y = typename decltype(ty)::type;
      if constexpr (std::is_same_v<X, Y> || std::is_same_v<X, float>) return launch_scale<X, Y>(x, y, n, scale, stream);
      return cudaErrorInvalidValue;
    });
  });
}

}  // namespace strobe::ops::cuda
