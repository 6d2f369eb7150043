// Multi-tensor kernels: non-finite check (+ L2 norm), fused Adam/AdamW/SGD steps and the weight
// average's update (ema_update).
//
// Each launch covers up to k*MaxTensors tensors described in the kernel parameters; every block
// owns one chunk of kChunk elements of one tensor (block -> tensor by binary search over the
// per-tensor block offsets). Reductions are per-block partials summed in a fixed order by one
// finalize block, so results are bitwise reproducible. Optimizer kernels skip the whole update
// when *found_nonfinite != 0 (read on the device: no host sync), and mirror torch::optim's order
// of fp32 operations so that 100 steps agree to fp32 rounding. No --use_fast_math: sqrt and
// division must round like ATen's.
#include "strobe/ops/cuda/common.cuh"
#include "strobe/ops/cuda/launchers.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace strobe::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 16384;  // elements per block: 16 float4 per thread

// Loads 4 consecutive elements starting at i (i a multiple of 4, base 16-byte aligned).
__device__ __forceinline__ void load4_as_float(const void* base, int64_t i, DType dt, float out[4]) {
  switch (dt) {
    case DType::kFloat16: {
      const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __half*>(base) + i);
      const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
      const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
      out[0] = a.x; out[1] = a.y; out[2] = b.x; out[3] = b.y;
      break;
    }
    case DType::kBFloat16: {
      const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(base) + i);
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
      out[0] = a.x; out[1] = a.y; out[2] = b.x; out[3] = b.y;
      break;
    }
    case DType::kFloat64:
#pragma unroll
      for (int k = 0; k < 4; ++k) out[k] = static_cast<float>(static_cast<const double*>(base)[i + k]);
      break;
    default: {
      const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
      out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    }
  }
}

__device__ __forceinline__ bool is_aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Tensor index of `block` given ascending block_start[0..n] (block_start[n] = total blocks).
__device__ __forceinline__ int tensor_of_block(const int* block_start, int n, int block) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (block_start[mid] <= block) lo = mid; else hi = mid - 1;
  }
  return lo;
}

int blocks_for(int64_t numel) { return static_cast<int>((numel + kChunk - 1) / kChunk); }

// The prologue every multi-tensor kernel shares: this block's chunk, the tensor it falls in and
// [begin, end) of that tensor's elements (kChunk of them, fewer at a tensor's end).
struct Chunk {
  int tensor;
  int64_t begin, end;
};
template <typename NumelOf>
__device__ __forceinline__ Chunk block_chunk(const int* block_start, int num_tensors, NumelOf numel_of) {
  const int t = tensor_of_block(block_start, num_tensors, blockIdx.x);
  const int64_t begin = static_cast<int64_t>(blockIdx.x - block_start[t]) * kChunk;
  return {t, begin, min(begin + kChunk, numel_of(t))};
}

// This thread's elements of chunk `c`: with `vec` (every operand 16-byte aligned, no fp64),
// quad(i) for each of its groups of 4 (i a multiple of 4), then one(i) for the tail; else one(i)
// for each element.
template <typename Quad, typename One>
__device__ __forceinline__ void for_each_element(const Chunk& c, bool vec, Quad quad, One one) {
  int64_t scalar_begin = c.begin;
  if (vec) {
    const int64_t vec_end = c.begin + ((c.end - c.begin) & ~int64_t{3});
    for (int64_t i = c.begin + 4 * threadIdx.x; i < vec_end; i += 4 * kThreads) quad(i);
    scalar_begin = vec_end;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < c.end; i += kThreads) one(i);
}

// ---- non-finite check --------------------------------------------------------------------------
struct NonfiniteLaunch {
  const void* data[kNonfiniteMaxTensors];
  int64_t numel[kNonfiniteMaxTensors];
  int block_start[kNonfiniteMaxTensors + 1];
  DType dtype[kNonfiniteMaxTensors];
  int num_tensors;
  bool with_norm;
  float* partial_sumsq;  // already offset to this launch's first block
  int* partial_found;
};

__global__ void __launch_bounds__(kThreads) nonfinite_kernel(const NonfiniteLaunch L) {
  const Chunk c = block_chunk(L.block_start, L.num_tensors, [&](int t) { return L.numel[t]; });
  const void* base = L.data[c.tensor];
  const DType dt = L.dtype[c.tensor];
  int bad = 0;
  float sumsq = 0.f;
  for_each_element(
      c, is_aligned16(base) && dt != DType::kFloat64,
      [&](int64_t i) {
        float v[4];
        load4_as_float(base, i, dt, v);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          bad |= !isfinite(v[k]);
          sumsq = fmaf(v[k], v[k], sumsq);
        }
      },
      [&](int64_t i) {
        // fp64 is checked in fp64 (a finite double can round to an infinite float).
        if (dt == DType::kFloat64) bad |= !isfinite(static_cast<const double*>(base)[i]);
        const float v = load_as_float(base, i, dt);
        bad |= !isfinite(v) && dt != DType::kFloat64;
        sumsq = fmaf(v, v, sumsq);
      });
  bad = __syncthreads_or(bad);
  if (L.with_norm) {
    __shared__ float sh[kThreads / 32];
    sumsq = block_sum_to_thread0<kThreads>(sumsq, sh);
  }
  if (threadIdx.x == 0) {
    L.partial_found[blockIdx.x] = bad;
    if (L.with_norm) L.partial_sumsq[blockIdx.x] = sumsq;
  }
}

constexpr int kFinalizeThreads = 512;

__global__ void __launch_bounds__(kFinalizeThreads)
    nonfinite_finalize_kernel(const float* partial_sumsq, const int* partial_found, int64_t n,
                              float* found, float* norm) {
  __shared__ double sh[kFinalizeThreads];
  double s = 0.0;
  int bad = 0;
  for (int64_t i = threadIdx.x; i < n; i += kFinalizeThreads) {
    bad |= partial_found[i];
    if (norm != nullptr) s += partial_sumsq[i];
  }
  bad = __syncthreads_or(bad);
  if (norm != nullptr) {
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int half = kFinalizeThreads / 2; half > 0; half >>= 1) {
      if (threadIdx.x < half) sh[threadIdx.x] += sh[threadIdx.x + half];
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) {
    *found = bad ? 1.f : 0.f;
    if (norm != nullptr) *norm = static_cast<float>(sqrt(sh[0]));
  }
}

// ---- Adam / AdamW ------------------------------------------------------------------------------
struct AdamLaunch {
  AdamTensor tensors[kAdamMaxTensors];
  int block_start[kAdamMaxTensors + 1];
  int num_tensors;
  AdamHyper hyper;
};

struct AdamScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, bc2_sqrt, neg_step_size, decay, wd;
};

__device__ __forceinline__ void adam_update(float& p, float g, float& m, float& v, float* vmax,
                                            const AdamScalars& s, bool amsgrad, bool decoupled) {
  if (decoupled) {
    p = p * s.decay;  // p.mul_(1 - lr * wd)
  } else {
    g = g + s.wd * p;  // grad.add(p, wd)
  }
  m = m * s.beta1 + s.one_minus_beta1 * g;  // exp_avg.mul_(beta1).add_(grad, 1 - beta1)
  v = v * s.beta2 + s.one_minus_beta2 * (g * g);  // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1-beta2)
  float second = v;
  if (amsgrad) {
    *vmax = fmaxf(*vmax, v);
    second = *vmax;
  }
  const float denom = sqrtf(second) / s.bc2_sqrt + s.eps;
  p = p + s.neg_step_size * (m / denom);  // p.addcdiv_(exp_avg, denom, -step_size)
}

__global__ void __launch_bounds__(kThreads) adam_kernel(const AdamLaunch L) {
  const AdamHyper& h = L.hyper;
  if (h.found_nonfinite != nullptr && *h.found_nonfinite != 0.f) return;
  const Chunk c = block_chunk(L.block_start, L.num_tensors, [&](int t) { return L.tensors[t].numel; });
  const AdamTensor& T = L.tensors[c.tensor];
  const double step = static_cast<double>(*T.step) + 1.0;
  const double bc1 = 1.0 - pow(h.beta1, step);
  const double bc2 = 1.0 - pow(h.beta2, step);
  AdamScalars s;
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.bc2_sqrt = static_cast<float>(sqrt(bc2));
  const double lr = h.lr_device != nullptr ? *h.lr_device : h.lr;
  s.neg_step_size = static_cast<float>(-(lr / bc1));
  s.decay = static_cast<float>(1.0 - lr * h.weight_decay);
  s.wd = static_cast<float>(h.weight_decay);
  const float mult = h.grad_multiplier != nullptr ? *h.grad_multiplier : 1.f;
  const bool use_mult = h.grad_multiplier != nullptr;
  const bool vec = is_aligned16(T.param) && is_aligned16(T.grad) && is_aligned16(T.exp_avg) &&
                   is_aligned16(T.exp_avg_sq) &&
                   (!h.amsgrad || is_aligned16(T.max_exp_avg_sq)) && T.grad_dtype != DType::kFloat64;
  for_each_element(
      c, vec,
      [&](int64_t i) {
        float g[4];
        load4_as_float(T.grad, i, T.grad_dtype, g);
        float4 p = *reinterpret_cast<float4*>(T.param + i);
        float4 m = *reinterpret_cast<float4*>(T.exp_avg + i);
        float4 v = *reinterpret_cast<float4*>(T.exp_avg_sq + i);
        float4 vm = h.amsgrad ? *reinterpret_cast<float4*>(T.max_exp_avg_sq + i) : make_float4(0, 0, 0, 0);
        if (use_mult) {
#pragma unroll
          for (int k = 0; k < 4; ++k) g[k] *= mult;
        }
        adam_update(p.x, g[0], m.x, v.x, &vm.x, s, h.amsgrad, h.decoupled_weight_decay);
        adam_update(p.y, g[1], m.y, v.y, &vm.y, s, h.amsgrad, h.decoupled_weight_decay);
        adam_update(p.z, g[2], m.z, v.z, &vm.z, s, h.amsgrad, h.decoupled_weight_decay);
        adam_update(p.w, g[3], m.w, v.w, &vm.w, s, h.amsgrad, h.decoupled_weight_decay);
        *reinterpret_cast<float4*>(T.param + i) = p;
        *reinterpret_cast<float4*>(T.exp_avg + i) = m;
        *reinterpret_cast<float4*>(T.exp_avg_sq + i) = v;
        if (h.amsgrad) *reinterpret_cast<float4*>(T.max_exp_avg_sq + i) = vm;
      },
      [&](int64_t i) {
        float g = load_as_float(T.grad, i, T.grad_dtype);
        if (use_mult) g *= mult;
        float vm = h.amsgrad ? T.max_exp_avg_sq[i] : 0.f;
        adam_update(T.param[i], g, T.exp_avg[i], T.exp_avg_sq[i], &vm, s, h.amsgrad, h.decoupled_weight_decay);
        if (h.amsgrad) T.max_exp_avg_sq[i] = vm;
      });
}

// Runs after the update kernel of the same tensors (same stream), so every block has read the
// old step count before it changes.
struct StepLaunch {
  float* step[kSgdMaxTensors];
  int num_tensors;
  const float* found_nonfinite;
};

__global__ void increment_steps_kernel(const StepLaunch L) {
  if (L.found_nonfinite != nullptr && *L.found_nonfinite != 0.f) return;
  for (int i = threadIdx.x; i < L.num_tensors; i += blockDim.x) *L.step[i] += 1.f;
}

// ---- SGD ---------------------------------------------------------------------------------------
struct SgdLaunch {
  SgdTensor tensors[kSgdMaxTensors];
  int block_start[kSgdMaxTensors + 1];
  int num_tensors;
  SgdHyper hyper;
};

__global__ void __launch_bounds__(kThreads) sgd_kernel(const SgdLaunch L) {
  const SgdHyper& h = L.hyper;
  if (h.found_nonfinite != nullptr && *h.found_nonfinite != 0.f) return;
  const Chunk c = block_chunk(L.block_start, L.num_tensors, [&](int t) { return L.tensors[t].numel; });
  const SgdTensor& T = L.tensors[c.tensor];
  const float mult = h.grad_multiplier != nullptr ? *h.grad_multiplier : 1.f;
  const bool use_mult = h.grad_multiplier != nullptr;
  const float wd = static_cast<float>(h.weight_decay);
  const float momentum = static_cast<float>(h.momentum);
  const float one_minus_dampening = static_cast<float>(1.0 - h.dampening);
  const float neg_lr = static_cast<float>(-(h.lr_device != nullptr ? *h.lr_device : h.lr));
  const bool has_buf = T.momentum_buffer != nullptr;
  const bool first = has_buf && *T.step == 0.f;
  const bool decay = h.weight_decay != 0.0;
  // One element: d_p = grad * mult (+ wd * p); momentum; p.add_(d_p, -lr).
  auto update = [&](float d, float& p, float* buf) {
    if (use_mult) d *= mult;
    if (decay) d = d + wd * p;  // d_p.add(p, wd)
    if (has_buf) {
      // First step: buf = clone(d_p); later: buf.mul_(momentum).add_(d_p, 1 - dampening).
      *buf = first ? d : *buf * momentum + one_minus_dampening * d;
      d = h.nesterov ? d + momentum * *buf : *buf;
    }
    p = p + neg_lr * d;
  };
  // 16-byte loads and stores where every operand is aligned: the step is bandwidth-bound (a
  // billion-weight head streams ~12 GB per step), and scalar accesses left a third of it unused.
  const bool vec = is_aligned16(T.param) && is_aligned16(T.grad) &&
                   (!has_buf || is_aligned16(T.momentum_buffer)) && T.grad_dtype != DType::kFloat64;
  for_each_element(
      c, vec,
      [&](int64_t i) {
        float g[4];
        load4_as_float(T.grad, i, T.grad_dtype, g);
        float4 p = *reinterpret_cast<float4*>(T.param + i);
        float4 b = has_buf ? *reinterpret_cast<float4*>(T.momentum_buffer + i) : make_float4(0, 0, 0, 0);
        update(g[0], p.x, &b.x);
        update(g[1], p.y, &b.y);
        update(g[2], p.z, &b.z);
        update(g[3], p.w, &b.w);
        *reinterpret_cast<float4*>(T.param + i) = p;
        if (has_buf) *reinterpret_cast<float4*>(T.momentum_buffer + i) = b;
      },
      [&](int64_t i) {
        float b = has_buf ? T.momentum_buffer[i] : 0.f;
        update(load_as_float(T.grad, i, T.grad_dtype), T.param[i], &b);
        if (has_buf) T.momentum_buffer[i] = b;
      });
}

// ---- weight averaging --------------------------------------------------------------------------
struct EmaLaunch {
  EmaTensor tensors[kEmaMaxTensors];
  int block_start[kEmaMaxTensors + 1];
  int num_tensors;
  EmaHyper hyper;
};

// avg += weight * (src - avg), in fp32 (torch.lerp's form for weights below one half).
__global__ void __launch_bounds__(kThreads) ema_kernel(const EmaLaunch L) {
  const EmaHyper& h = L.hyper;
  if (h.skip != nullptr && *h.skip != 0.f) return;
  const Chunk c = block_chunk(L.block_start, L.num_tensors, [&](int t) { return L.tensors[t].numel; });
  const EmaTensor& T = L.tensors[c.tensor];
  const float w = h.weight;
  for_each_element(
      c, is_aligned16(T.avg) && is_aligned16(T.src) && T.src_dtype != DType::kFloat64,
      [&](int64_t i) {
        float s[4];
        load4_as_float(T.src, i, T.src_dtype, s);
        float4 a = *reinterpret_cast<float4*>(T.avg + i);
        a.x = a.x + w * (s[0] - a.x);
        a.y = a.y + w * (s[1] - a.y);
        a.z = a.z + w * (s[2] - a.z);
        a.w = a.w + w * (s[3] - a.w);
        *reinterpret_cast<float4*>(T.avg + i) = a;
      },
      [&](int64_t i) {
        const float a = T.avg[i];
        T.avg[i] = a + w * (load_as_float(T.src, i, T.src_dtype) - a);
      });
}

template <typename Launch>
void fill_block_starts(Launch& L, const int64_t* numels, int n) {
  L.block_start[0] = 0;
  for (int i = 0; i < n; ++i) L.block_start[i + 1] = L.block_start[i] + blocks_for(numels[i]);
}

cudaError_t launch_increment(float* const* steps, int n, const float* found, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  StepLaunch S;
  S.num_tensors = n;
  S.found_nonfinite = found;
  std::copy(steps, steps + n, S.step);
  increment_steps_kernel<<<1, 256, 0, stream>>>(S);
  return cudaGetLastError();
}

}  // namespace

int64_t nonfinite_num_partials(const NonfiniteTensor* tensors, int num_tensors) {
  int64_t total = 0;
  for (int i = 0; i < num_tensors; ++i) total += blocks_for(tensors[i].numel);
  return total;
}

cudaError_t nonfinite_check(const NonfiniteTensor* tensors, int num_tensors, float* partial_sumsq,
                            int* partial_found, float* found, float* norm, cudaStream_t stream) {
  // The launch descriptor is ~22 KiB: keep it off the (small) host stack.
  static thread_local NonfiniteLaunch L;
  int64_t offset = 0;
  int i = 0;
  while (i < num_tensors) {
    L.num_tensors = 0;
    L.with_norm = norm != nullptr;
    L.partial_sumsq = partial_sumsq + offset;
    L.partial_found = partial_found + offset;
    L.block_start[0] = 0;
    for (; i < num_tensors && L.num_tensors < kNonfiniteMaxTensors; ++i) {
      if (tensors[i].numel == 0) continue;
      const int k = L.num_tensors++;
      L.data[k] = tensors[i].data;
      L.numel[k] = tensors[i].numel;
      L.dtype[k] = tensors[i].dtype;
      L.block_start[k + 1] = L.block_start[k] + blocks_for(tensors[i].numel);
    }
    if (L.num_tensors == 0) break;
    const int blocks = L.block_start[L.num_tensors];
    nonfinite_kernel<<<blocks, kThreads, 0, stream>>>(L);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    offset += blocks;
  }
  nonfinite_finalize_kernel<<<1, kFinalizeThreads, 0, stream>>>(partial_sumsq, partial_found,
                                                                 offset, found, norm);
  return cudaGetLastError();
}

cudaError_t fused_adam(const AdamTensor* tensors, int num_tensors, const AdamHyper& hyper,
                       cudaStream_t stream) {
  static thread_local AdamLaunch L;
  float* steps[kAdamMaxTensors];
  int64_t numels[kAdamMaxTensors];
  for (int i = 0; i < num_tensors;) {
    L.num_tensors = 0;
    L.hyper = hyper;
    for (; i < num_tensors && L.num_tensors < kAdamMaxTensors; ++i) {
      if (tensors[i].numel == 0) continue;
      const int k = L.num_tensors++;
      L.tensors[k] = tensors[i];
      numels[k] = tensors[i].numel;
      steps[k] = tensors[i].step;
    }
    if (L.num_tensors == 0) break;
    fill_block_starts(L, numels, L.num_tensors);
    adam_kernel<<<L.block_start[L.num_tensors], kThreads, 0, stream>>>(L);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    if (cudaError_t e = launch_increment(steps, L.num_tensors, hyper.found_nonfinite, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

cudaError_t fused_sgd(const SgdTensor* tensors, int num_tensors, const SgdHyper& hyper,
                      cudaStream_t stream) {
  static thread_local SgdLaunch L;
  float* steps[kSgdMaxTensors];
  int64_t numels[kSgdMaxTensors];
  for (int i = 0; i < num_tensors;) {
    L.num_tensors = 0;
    L.hyper = hyper;
    int num_steps = 0;
    for (; i < num_tensors && L.num_tensors < kSgdMaxTensors; ++i) {
      if (tensors[i].numel == 0) continue;
      const int k = L.num_tensors++;
      L.tensors[k] = tensors[i];
      numels[k] = tensors[i].numel;
      if (tensors[i].step != nullptr) steps[num_steps++] = tensors[i].step;
    }
    if (L.num_tensors == 0) break;
    fill_block_starts(L, numels, L.num_tensors);
    sgd_kernel<<<L.block_start[L.num_tensors], kThreads, 0, stream>>>(L);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    if (cudaError_t e = launch_increment(steps, num_steps, hyper.found_nonfinite, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

cudaError_t ema_update(const EmaTensor* tensors, int num_tensors, const EmaHyper& hyper, cudaStream_t stream) {
  static thread_local EmaLaunch L;
  int64_t numels[kEmaMaxTensors];
  for (int i = 0; i < num_tensors;) {
    L.num_tensors = 0;
    L.hyper = hyper;
    for (; i < num_tensors && L.num_tensors < kEmaMaxTensors; ++i) {
      if (tensors[i].numel == 0) continue;
      const int k = L.num_tensors++;
      L.tensors[k] = tensors[i];
      numels[k] = tensors[i].numel;
    }
    if (L.num_tensors == 0) break;
    fill_block_starts(L, numels, L.num_tensors);
    ema_kernel<<<L.block_start[L.num_tensors], kThreads, 0, stream>>>(L);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace strobe::ops::cuda
