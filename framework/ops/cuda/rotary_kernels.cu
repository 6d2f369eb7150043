// Rotary position embedding on q and k in one kernel (launcher in rotary.h), in Hugging Face's
// rotate-half convention and numerics: no `cat`, no `neg`, no copy of the rotated half. Each thread
// owns VEC pairs (element i of the first half of a head, element i + h of the second) of one head of
// one token: two vector loads of x, four of the fp32 tables (shared by the token's heads, so they
// stay in L1/L2), two vector stores. Products and sums use __fmul_rn / __fadd_rn and round to the
// storage type after each, exactly where ATen's `x * cos + rotate_half(x) * sin` (and autograd's
// backward of it) rounds: no fused multiply-add may merge them.
#include <algorithm>

#include "framework/ops/cuda/common.cuh"
#include "framework/ops/cuda/rotary.h"

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

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) rotary_kernel(RotaryParams p) {
  const int h = p.head_dim / 2;
  const int chunks = h / VEC;  // vectors per half head
  const int heads = p.q_heads + p.k_heads;
  const int64_t items = p.tokens * heads * chunks;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; item < items;
       item += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int chunk = static_cast<int>(item % chunks);
    const int64_t th = item / chunks;
    const int head = static_cast<int>(th % heads);
    const int64_t token = th / heads;
    const bool is_q = head < p.q_heads;
    const int64_t row = is_q ? token * p.q_heads + head : token * p.k_heads + (head - p.q_heads);
    const T* x = static_cast<const T*>(is_q ? p.q : p.k) + row * p.head_dim;
    T* y = static_cast<T*>(is_q ? p.q_out : p.k_out) + row * p.head_dim;
    const int i = chunk * VEC;
    const Pack<T, VEC> a = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
    const Pack<T, VEC> b = *reinterpret_cast<const Pack<T, VEC>*>(x + i + h);
    const float* ct = p.cos + token * p.head_dim;
    const float* st = p.sin + token * p.head_dim;
    Pack<T, VEC> oa, ob;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      // The tables rounded to T, as HF's cos.to(x.dtype).
      const float c1 = to_f(from_f<T>(ct[i + j])), c2 = to_f(from_f<T>(ct[i + h + j]));
      const float s1 = to_f(from_f<T>(st[i + j])), s2 = to_f(from_f<T>(st[i + h + j]));
      const float x1 = to_f(a.v[j]), x2 = to_f(b.v[j]);
      if (!p.backward) {
        oa.v[j] = from_f<T>(add_t<T>(mul_t<T>(x1, c1), mul_t<T>(-x2, s1)));
        ob.v[j] = from_f<T>(add_t<T>(mul_t<T>(x2, c2), mul_t<T>(x1, s2)));
      } else {
        oa.v[j] = from_f<T>(add_t<T>(mul_t<T>(x1, c1), mul_t<T>(x2, s2)));
        ob.v[j] = from_f<T>(add_t<T>(mul_t<T>(x2, c2), -mul_t<T>(x1, s1)));
      }
    }
    *reinterpret_cast<Pack<T, VEC>*>(y + i) = oa;
    *reinterpret_cast<Pack<T, VEC>*>(y + i + h) = ob;
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T>
cudaError_t launch(const RotaryParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int h = p.head_dim / 2;
  // 16-byte vectors when both halves of every head start 16-byte aligned.
  const bool vec = h % kVec == 0 && aligned16(p.q) && aligned16(p.k) && aligned16(p.q_out) && aligned16(p.k_out);
  const int64_t items = p.tokens * (p.q_heads + p.k_heads) * (vec ? h / kVec : h);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, 132 * 16));
  if (vec) rotary_kernel<T, kVec><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  else rotary_kernel<T, 1><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

int rotary_max_head_dim() { return 512; }

cudaError_t rotary_qk(const RotaryParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.q_heads + p.k_heads == 0) return cudaSuccess;
  if (p.head_dim % 2 != 0 || p.head_dim > rotary_max_head_dim()) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return launch<float>(p, stream);
    case DType::kFloat16: return launch<__half>(p, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace strobe::ops::cuda
