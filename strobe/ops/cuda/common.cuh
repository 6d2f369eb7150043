// What the CUDA kernels here share (as llm.c's cuda_common.h does for all of its kernels): the
// conversions between storage types and fp32, element access by a runtime DType, vector loads and
// stores, and warp / block sums in a fixed order (the same inputs sum in the same order on every
// run and every GPU: the bitwise reproducibility the ops promise rests on it). Device code only;
// no torch header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "strobe/ops/cuda/dtype.h"

namespace strobe::ops::cuda {

// ---- conversions (round to nearest even) ---------------------------------------------------------
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// ---- elements of a runtime type ------------------------------------------------------------------
// Element i of `p` as fp32 (fp64 is rounded; uint8 is its value).
__device__ __forceinline__ float load_as_float(const void* p, int64_t i, DType dt) {
  switch (dt) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kFloat64: return static_cast<float>(static_cast<const double*>(p)[i]);
    case DType::kUInt8: return static_cast<float>(static_cast<const uint8_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
// Element i of `p` = v, rounded to fp16 / bf16 (fp32 otherwise).
__device__ __forceinline__ void store_from_float(void* p, int64_t i, float v, DType dt) {
  switch (dt) {
    case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// ---- vectors -------------------------------------------------------------------------------------
// N elements moved in one load or store (the address aligned to the whole pack).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// 8 elements <-> 8 floats in one 16-byte access (two for fp32; the address 16-byte aligned).
template <typename T>
struct Vec8;
template <>
struct Vec8<float> {
  __device__ static void load(const float* p, float (&v)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
  __device__ static void store(float* p, const float (&v)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
};
template <>
struct Vec8<__nv_bfloat16> {
  __device__ static void load(const __nv_bfloat16* p, float (&v)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
  }
  __device__ static void store(__nv_bfloat16* p, const float (&v)[8]) {
    uint4 raw;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
};
template <>
struct Vec8<__half> {
  __device__ static void load(const __half* p, float (&v)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const auto* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
  }
  __device__ static void store(__half* p, const float (&v)[8]) {
    uint4 raw;
    auto* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
};

// ---- sums in a fixed order -----------------------------------------------------------------------
// Butterfly over the warp: every lane gets the same sum.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Tree over the warp: lane 0 gets the sum (the other lanes hold partial sums).
template <typename T>
__device__ __forceinline__ T warp_sum_to_lane0(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, returned to every thread. `sh` holds 32 values; the leading __syncthreads
// makes back-to-back calls safe.
__device__ __forceinline__ float block_sum(float v, float* sh) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
  const int nw = (blockDim.x + 31) >> 5;
  for (int i = 0; i < nw; ++i) t += sh[i];
  return t;
}

// Sum over a block of kThreads threads, valid in thread 0: warp trees, then warp 0 over the warp
// sums. `sh` holds kThreads / 32 values; every thread of the block must call it.
template <int kThreads, typename T>
__device__ __forceinline__ T block_sum_to_thread0(T v, T* sh) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 1024 threads");
  v = warp_sum_to_lane0(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) v = warp_sum_to_lane0(lane < kThreads / 32 ? sh[lane] : T(0));
  return v;
}

// ---- amax (max |x|) for float8 scaling ----------------------------------------------------------
// |v| as the bits of a non-negative float: their unsigned order is the float order, and a NaN's bits
// are above +Inf's, so a NaN anywhere wins the maximum.
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(fabsf(v)); }

// The maximum of every thread's `m` (abs_bits) over a block of kThreads threads, folded into *amax
// (zeroed before the launch) by one atomicMax per block. Every thread of the block must call it.
template <int kThreads>
__device__ __forceinline__ void block_amax_to(unsigned m, unsigned* amax) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 1024 threads");
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ unsigned warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x == 0 && m != 0) atomicMax(amax, m);
  }
}

// block_amax_to for a block of any whole number of warps (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ void block_amax_any(unsigned m, unsigned* amax) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ unsigned warp_max[32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x == 0 && m != 0) atomicMax(amax, m);
  }
}

// ---- launcher dispatch ---------------------------------------------------------------------------
// A storage type handed to a launcher's generic lambda: `using T = typename decltype(t)::type;`.
template <typename T>
struct As {
  using type = T;
};

// The one switch from a runtime DType to the storage type a kernel is instantiated for: f(As<T>{})
// with T float, __half or __nv_bfloat16; another DType (float64, uint8) is cudaErrorInvalidValue.
// `f` returns cudaError_t.
template <typename F>
inline cudaError_t dispatch_float(DType dt, F&& f) {
  switch (dt) {
    case DType::kFloat32: return f(As<float>{});
    case DType::kFloat16: return f(As<__half>{});
    case DType::kBFloat16: return f(As<__nv_bfloat16>{});
    default: return cudaErrorInvalidValue;
  }
}

// The same, with float64 as a fourth type (the GIoU loss's targets).
template <typename F>
inline cudaError_t dispatch_float_or_double(DType dt, F&& f) {
  if (dt == DType::kFloat64) return f(As<double>{});
  return dispatch_float(dt, std::forward<F>(f));
}

}  // namespace strobe::ops::cuda
