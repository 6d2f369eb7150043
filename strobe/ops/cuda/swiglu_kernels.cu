// SwiGLU, silu(gate) * up, forward and backward over one [rows, 2 x cols] projection output (launchers
// in swiglu.h). Memory-bound: the forward reads gate and up once and writes y once; the backward reads
// dy, gate and up once and writes d gate and d up once (no silu output is kept: it is recomputed).
// Each thread owns a 16-byte vector of columns of one row; products and sums use __fmul_rn /
// __fadd_rn and round to the storage type where ATen rounds, exp is expf (ATen's, not __expf). With
// AMAX the kernel also folds max |output| (the rounded values) into a device float: a block reduction
// and one atomicMax per block (block_amax_to, common.cuh), the amax a float8 cast of the output needs.
#include <algorithm>

#include "strobe/ops/cuda/common.cuh"
#include "strobe/ops/cuda/swiglu.h"

namespace strobe::ops::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float rt(float v) {
  return to_f(from_f<T>(v));
}

// ATen's silu: x / (1 + exp(-x)) in fp32.
__device__ __forceinline__ float silu_f(float x) { return __fdiv_rn(x, __fadd_rn(1.f, expf(-x))); }

template <typename T, int VEC, bool AMAX>
__global__ void __launch_bounds__(kThreads) swiglu_fwd_kernel(const T* __restrict__ gu, T* __restrict__ y, int64_t rows,
                                                            int64_t cols, unsigned* __restrict__ amax) {
  const int64_t per_row = cols / VEC, items = rows * per_row;
  unsigned m = 0;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; it < items;
       it += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = it / per_row, c = (it % per_row) * VEC;
    const Pack<T, VEC> g = *reinterpret_cast<const Pack<T, VEC>*>(gu + r * 2 * cols + c);
    const Pack<T, VEC> u = *reinterpret_cast<const Pack<T, VEC>*>(gu + r * 2 * cols + cols + c);
    Pack<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      o.v[j] = from_f<T>(__fmul_rn(rt<T>(silu_f(to_f(g.v[j]))), to_f(u.v[j])));
      if constexpr (AMAX) m = max(m, abs_bits(to_f(o.v[j])));
    }
    *reinterpret_cast<Pack<T, VEC>*>(y + r * cols + c) = o;
  }
  if constexpr (AMAX) block_amax_to<kThreads>(m, amax);
}

template <typename T, int VEC, bool AMAX>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ gu,
                                                            T* __restrict__ dgu, int64_t rows, int64_t cols,
                                                            unsigned* __restrict__ amax) {
  const int64_t per_row = cols / VEC, items = rows * per_row;
  unsigned m = 0;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; it < items;
       it += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = it / per_row, c = (it % per_row) * VEC;
    const Pack<T, VEC> d = *reinterpret_cast<const Pack<T, VEC>*>(dy + r * cols + c);
    const Pack<T, VEC> g = *reinterpret_cast<const Pack<T, VEC>*>(gu + r * 2 * cols + c);
    const Pack<T, VEC> u = *reinterpret_cast<const Pack<T, VEC>*>(gu + r * 2 * cols + cols + c);
    Pack<T, VEC> dg, du;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = to_f(g.v[j]), dyv = to_f(d.v[j]);
      const float s = rt<T>(silu_f(x));
      const float ds = rt<T>(__fmul_rn(dyv, to_f(u.v[j])));
      du.v[j] = from_f<T>(__fmul_rn(dyv, s));
      // ATen's silu_backward: dy * sig * (1 + x * (1 - sig)), sig = 1 / (1 + exp(-x)).
      const float sig = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-x)));
      dg.v[j] = from_f<T>(__fmul_rn(__fmul_rn(ds, sig), __fadd_rn(1.f, __fmul_rn(x, __fsub_rn(1.f, sig)))));
      if constexpr (AMAX) m = max(m, max(abs_bits(to_f(dg.v[j])), abs_bits(to_f(du.v[j]))));
    }
    *reinterpret_cast<Pack<T, VEC>*>(dgu + r * 2 * cols + c) = dg;
    *reinterpret_cast<Pack<T, VEC>*>(dgu + r * 2 * cols + cols + c) = du;
  }
  if constexpr (AMAX) block_amax_to<kThreads>(m, amax);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int64_t grid_for(int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, 132 * 32));
}

template <typename T, bool AMAX>
cudaError_t fwd(const void* gu, void* y, int64_t rows, int64_t cols, unsigned* amax, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = cols % kVec == 0 && aligned16(gu) && aligned16(y);
  const auto* g = static_cast<const T*>(gu);
  auto* o = static_cast<T*>(y);
  if (vec) swiglu_fwd_kernel<T, kVec, AMAX><<<grid_for(rows * cols / kVec), kThreads, 0, stream>>>(g, o, rows, cols, amax);
  else swiglu_fwd_kernel<T, 1, AMAX><<<grid_for(rows * cols), kThreads, 0, stream>>>(g, o, rows, cols, amax);
  return cudaGetLastError();
}

template <typename T, bool AMAX>
cudaError_t bwd(const void* dy, const void* gu, void* dgu, int64_t rows, int64_t cols, unsigned* amax,
                cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = cols % kVec == 0 && aligned16(dy) && aligned16(gu) && aligned16(dgu);
  const auto* d = static_cast<const T*>(dy);
  const auto* g = static_cast<const T*>(gu);
  auto* o = static_cast<T*>(dgu);
  if (vec)
    swiglu_bwd_kernel<T, kVec, AMAX><<<grid_for(rows * cols / kVec), kThreads, 0, stream>>>(d, g, o, rows, cols, amax);
  else
    swiglu_bwd_kernel<T, 1, AMAX><<<grid_for(rows * cols), kThreads, 0, stream>>>(d, g, o, rows, cols, amax);
  return cudaGetLastError();
}

// The amax starts at 0 (an empty output's amax); the kernels only raise it.
cudaError_t zero_amax(float* amax, cudaStream_t stream) {
  return amax == nullptr ? cudaSuccess : cudaMemsetAsync(amax, 0, sizeof(float), stream);
}

}  // namespace

cudaError_t swiglu_fwd(const void* gu, void* y, int64_t rows, int64_t cols, DType dtype, float* amax,
                       cudaStream_t stream) {
  if (cudaError_t e = zero_amax(amax, stream); e != cudaSuccess) return e;
  if (rows == 0 || cols == 0) return cudaSuccess;
  auto* bits = reinterpret_cast<unsigned*>(amax);
  return dispatch_float(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return amax != nullptr ? fwd<T, true>(gu, y, rows, cols, bits, stream) : fwd<T, false>(gu, y, rows, cols, bits, stream);
  });
}

cudaError_t swiglu_bwd(const void* dy, const void* gu, void* dgu, int64_t rows, int64_t cols, DType dtype, float* amax,
                       cudaStream_t stream) {
  if (cudaError_t e = zero_amax(amax, stream); e != cudaSuccess) return e;
  if (rows == 0 || cols == 0) return cudaSuccess;
  auto* bits = reinterpret_cast<unsigned*>(amax);
  return dispatch_float(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return amax != nullptr ? bwd<T, true>(dy, gu, dgu, rows, cols, bits, stream)
                           : bwd<T, false>(dy, gu, dgu, rows, cols, bits, stream);
  });
}

}  // namespace strobe::ops::cuda
