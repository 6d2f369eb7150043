// SwiGLU, silu(gate) * up, forward and backward over one [rows, 2 x cols] projection output (launchers
// in swiglu.h). Memory-bound: the forward reads gate and up once and writes y once; the backward reads
// dy, gate and up once and writes d gate and d up once (no silu output is kept: it is recomputed).
// Each thread owns a 16-byte vector of columns of one row; products and sums use __fmul_rn /
// __fadd_rn and round to the storage type where ATen rounds, exp is expf (ATen's, not __expf).
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

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) swiglu_fwd_kernel(const T* __restrict__ gu, T* __restrict__ y, int64_t rows,
                                                            int64_t cols) {
  const int64_t per_row = cols / VEC, items = rows * per_row;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; it < items;
       it += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = it / per_row, c = (it % per_row) * VEC;
    const Pack<T, VEC> g = *reinterpret_cast<const Pack<T, VEC>*>(gu + r * 2 * cols + c);
    const Pack<T, VEC> u = *reinterpret_cast<const Pack<T, VEC>*>(gu + r * 2 * cols + cols + c);
    Pack<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = from_f<T>(__fmul_rn(rt<T>(silu_f(to_f(g.v[j]))), to_f(u.v[j])));
    *reinterpret_cast<Pack<T, VEC>*>(y + r * cols + c) = o;
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ gu,
                                                            T* __restrict__ dgu, int64_t rows, int64_t cols) {
  const int64_t per_row = cols / VEC, items = rows * per_row;
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
    }
    *reinterpret_cast<Pack<T, VEC>*>(dgu + r * 2 * cols + c) = dg;
    *reinterpret_cast<Pack<T, VEC>*>(dgu + r * 2 * cols + cols + c) = du;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int64_t grid_for(int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, 132 * 32));
}

template <typename T>
cudaError_t fwd(const void* gu, void* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = cols % kVec == 0 && aligned16(gu) && aligned16(y);
  const auto* g = static_cast<const T*>(gu);
  auto* o = static_cast<T*>(y);
  if (vec) swiglu_fwd_kernel<T, kVec><<<grid_for(rows * cols / kVec), kThreads, 0, stream>>>(g, o, rows, cols);
  else swiglu_fwd_kernel<T, 1><<<grid_for(rows * cols), kThreads, 0, stream>>>(g, o, rows, cols);
  return cudaGetLastError();
}

template <typename T>
cudaError_t bwd(const void* dy, const void* gu, void* dgu, int64_t rows, int64_t cols, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = cols % kVec == 0 && aligned16(dy) && aligned16(gu) && aligned16(dgu);
  const auto* d = static_cast<const T*>(dy);
  const auto* g = static_cast<const T*>(gu);
  auto* o = static_cast<T*>(dgu);
  if (vec) swiglu_bwd_kernel<T, kVec><<<grid_for(rows * cols / kVec), kThreads, 0, stream>>>(d, g, o, rows, cols);
  else swiglu_bwd_kernel<T, 1><<<grid_for(rows * cols), kThreads, 0, stream>>>(d, g, o, rows, cols);
  return cudaGetLastError();
}

}  // namespace

cudaError_t swiglu_fwd(const void* gu, void* y, int64_t rows, int64_t cols, DType dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  return dispatch_float(dtype, [&](auto t) { return fwd<typename decltype(t)::type>(gu, y, rows, cols, stream); });
}

cudaError_t swiglu_bwd(const void* dy, const void* gu, void* dgu, int64_t rows, int64_t cols, DType dtype,
                       cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  return dispatch_float(dtype, [&](auto t) { return bwd<typename decltype(t)::type>(dy, gu, dgu, rows, cols, stream); });
}

}  // namespace strobe::ops::cuda
