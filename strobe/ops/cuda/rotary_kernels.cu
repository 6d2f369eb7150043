// Rotary position embedding on q and k in one kernel (launcher in rotary.h), in Hugging Face's
// rotate-half convention and numerics: no `cat`, no `neg`, no copy of the rotated half. Each thread
// owns VEC pairs (element i of the first half of a head, element i + h of the second) of one token
// for a group of kHeadGroup heads (q's and k's heads in one index space): it reads the four table
// vectors once, rounded to the storage type, then rotates the group's heads with two vector loads
// and two vector stores each. Products and sums use __fmul_rn / __fadd_rn and round to the storage
// type after each, exactly where ATen's `x * cos + rotate_half(x) * sin` (and autograd's backward of
// it) rounds: no fused multiply-add may merge them.
// v1 (one thread per head and vector, the tables read per head with scalar loads, 64-bit index
// division per item) ran at 2.27x its HBM bound on the llama step; v2 is this one
// (docs/PERFORMANCE.md, "The llama step with every fused op").
#include <algorithm>

#include "strobe/ops/cuda/common.cuh"
#include "strobe/ops/cuda/rotary.h"

namespace strobe::ops::cuda {
namespace {

constexpr int kThreads = 256;

// a * b rounded to T (computed in fp32, as ATen's opmath for 16-bit types).
template <typename T>
__device__ __forceinline__ float mul_t(float a, float b) {
  return to_f(from_f<T>(__fmul_rn(a, b)));
}
template <typename T>
__device__ __forceinline__ float add_t(float a, float b) {
  return to_f(from_f<T>(__fadd_rn(a, b)));
}

constexpr int kHeadGroup = 8;

template <typename T, int VEC>
__device__ __forceinline__ void load_table(const float* t, float (&out)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 4) {
      const float4 v = *reinterpret_cast<const float4*>(t + j);
      out[j] = v.x, out[j + 1] = v.y, out[j + 2] = v.z, out[j + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = t[j];
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = to_f(from_f<T>(out[j]));  // HF's cos.to(x.dtype)
}

template <typename T, int VEC, bool BACKWARD>
__global__ void __launch_bounds__(kThreads) rotary_kernel(RotaryParams p) {
  const int h = p.head_dim / 2;
  const int chunks = h / VEC;  // vectors per half head
  const int heads = p.q_heads + p.k_heads;
  const int groups = (heads + kHeadGroup - 1) / kHeadGroup;
  const int64_t items = p.tokens * groups * chunks;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; item < items;
       item += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int chunk = static_cast<int>(item % chunks);
    const int64_t tg = item / chunks;
    const int group = static_cast<int>(tg % groups);
    const int64_t token = tg / groups;
    const int i = chunk * VEC;
    float c1[VEC], c2[VEC], s1[VEC], s2[VEC];
    load_table<T, VEC>(p.cos + token * p.head_dim + i, c1);
    load_table<T, VEC>(p.cos + token * p.head_dim + i + h, c2);
    load_table<T, VEC>(p.sin + token * p.head_dim + i, s1);
    load_table<T, VEC>(p.sin + token * p.head_dim + i + h, s2);
    const int first = group * kHeadGroup, last = min(first + kHeadGroup, heads);
#pragma unroll 4
    for (int head = first; head < last; ++head) {
      const bool is_q = head < p.q_heads;
      const int64_t row = is_q ? token * p.q_heads + head : token * p.k_heads + (head - p.q_heads);
      const T* x = static_cast<const T*>(is_q ? p.q : p.k) + row * p.head_dim + i;
      T* y = static_cast<T*>(is_q ? p.q_out : p.k_out) + row * p.head_dim + i;
      const Pack<T, VEC> a = *reinterpret_cast<const Pack<T, VEC>*>(x);
      const Pack<T, VEC> b = *reinterpret_cast<const Pack<T, VEC>*>(x + h);
      Pack<T, VEC> oa, ob;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float x1 = to_f(a.v[j]), x2 = to_f(b.v[j]);
        if constexpr (!BACKWARD) {
          oa.v[j] = from_f<T>(add_t<T>(mul_t<T>(x1, c1[j]), mul_t<T>(-x2, s1[j])));
          ob.v[j] = from_f<T>(add_t<T>(mul_t<T>(x2, c2[j]), mul_t<T>(x1, s2[j])));
        } else {
          oa.v[j] = from_f<T>(add_t<T>(mul_t<T>(x1, c1[j]), mul_t<T>(x2, s2[j])));
          ob.v[j] = from_f<T>(add_t<T>(mul_t<T>(x2, c2[j]), -mul_t<T>(x1, s1[j])));
        }
      }
      *reinterpret_cast<Pack<T, VEC>*>(y) = oa;
      *reinterpret_cast<Pack<T, VEC>*>(y + h) = ob;
    }
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T, int VEC>
cudaError_t launch_vec(const RotaryParams& p, cudaStream_t stream) {
  const int heads = p.q_heads + p.k_heads;
  const int64_t items = p.tokens * ((heads + kHeadGroup - 1) / kHeadGroup) * (p.head_dim / 2 / VEC);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, 132 * 64));
  if (p.backward) rotary_kernel<T, VEC, true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  else rotary_kernel<T, VEC, false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const RotaryParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int h = p.head_dim / 2;
  // 16-byte vectors when both halves of every head and of every table row start 16-byte aligned.
  const bool vec = h % kVec == 0 && aligned16(p.q) && aligned16(p.k) && aligned16(p.q_out) && aligned16(p.k_out) &&
                   aligned16(p.cos) && aligned16(p.sin);
  return vec ? launch_vec<T, kVec>(p, stream) : launch_vec<T, 1>(p, stream);
}

}  // namespace

int rotary_max_head_dim() { return 512; }

cudaError_t rotary_qk(const RotaryParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.q_heads + p.k_heads == 0) return cudaSuccess;
  if (p.head_dim % 2 != 0 || p.head_dim > rotary_max_head_dim()) return cudaErrorInvalidValue;
  return dispatch_float(p.dtype, [&](auto t) { return launch<typename decltype(t)::type>(p, stream); });
}

}  // namespace strobe::ops::cuda
