// Fused residual-add + LayerNorm (forward, backward) and fused cross-entropy (forward, backward).
// Memory-bound kernels: the point is fewer passes over the activations, not arithmetic.
//   LayerNorm forward: one block per row; each thread keeps its elements of the row in registers
//     (16-byte vectors when cols allows), so the row is read once, the sum x + delta written once,
//     mean and variance taken in two passes over registers (no E[x^2] - E[x]^2 cancellation).
//   LayerNorm backward: a fixed grid of blocks strides over rows; per row dx in one pass, while
//     each thread accumulates its columns' dweight / dbias over the rows it visits. The per-block
//     partials are summed in a fixed order by a second kernel: deterministic, no atomics.
//   Cross-entropy: one warp per row; forward is an online logsumexp (one read of the logits),
//     backward one read and one write of the logits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "strobe/ops/cuda/common.cuh"
#include "strobe/ops/cuda/fused_norm.h"

namespace strobe::ops::cuda {
namespace {

// Vectors of VEC elements per thread and iteration; ITERS vectors per thread at most.
template <int VEC> struct Iters { static constexpr int value = VEC == 1 ? 4 : 1; };

// RMS: RMSNorm in Hugging Face's numerics (no centring; sum / rstd from the mean square; the
// normalised row rounded to T, then multiplied by the weight and rounded again).
template <typename T, int VEC, bool RMS>
__global__ void __launch_bounds__(1024) ln_fwd_kernel(LayerNormFwdParams p) {
  constexpr int ITERS = Iters<VEC>::value;
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const int nvec = p.cols / VEC;
  const T* x = static_cast<const T*>(p.x) + row * p.cols;
  const T* d = p.delta ? static_cast<const T*>(p.delta) + row * p.cols : nullptr;
  float v[ITERS][VEC];
  float s = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int iv = threadIdx.x + it * blockDim.x;
    if (iv >= nvec) continue;
    const Pack<T, VEC> xp = reinterpret_cast<const Pack<T, VEC>*>(x)[iv];
    if (d) {
      const Pack<T, VEC> dp = reinterpret_cast<const Pack<T, VEC>*>(d)[iv];
      Pack<T, VEC> sp;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        // Rounded to T: the LayerNorm sees exactly the residual stream it writes.
        sp.v[j] = from_f<T>(to_f(xp.v[j]) + to_f(dp.v[j]));
        v[it][j] = to_f(sp.v[j]);
      }
      reinterpret_cast<Pack<T, VEC>*>(static_cast<T*>(p.sum) + row * p.cols)[iv] = sp;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[it][j] = to_f(xp.v[j]);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += v[it][j];
  }
  const float inv_c = 1.f / static_cast<float>(p.cols);
  const float mean = RMS ? 0.f : block_sum(s, sh) * inv_c;
  float q = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    if (static_cast<int>(threadIdx.x + it * blockDim.x) >= nvec) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float c = v[it][j] - mean;
      q += c * c;
    }
  }
  const float rstd = rsqrtf(block_sum(q, sh) * inv_c + p.eps);
  T* y = static_cast<T*>(p.y) + row * p.cols;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int iv = threadIdx.x + it * blockDim.x;
    if (iv >= nvec) continue;
    Pack<T, VEC> yp;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const int c = iv * VEC + j;
      if (RMS) {
        yp.v[j] = from_f<T>(to_f(from_f<T>(v[it][j] * rstd)) * load_as_float(p.weight, c, p.param_dtype));
        continue;
      }
      float o = (v[it][j] - mean) * rstd * load_as_float(p.weight, c, p.param_dtype);
      if (p.bias) o += load_as_float(p.bias, c, p.param_dtype);
      yp.v[j] = from_f<T>(o);
    }
    reinterpret_cast<Pack<T, VEC>*>(y)[iv] = yp;
  }
  if (threadIdx.x == 0) {
    if (p.mean) p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
}

// RMS: xhat = sum * rstd; dx = rstd * (g - xhat * mean(g * xhat)); dweight sums dy * xhat rounded to
// T (the normalised row the forward multiplied by the weight); no dbias.
template <typename T, int VEC, bool RMS>
__global__ void __launch_bounds__(1024) ln_bwd_kernel(LayerNormBwdParams p) {
  constexpr int ITERS = Iters<VEC>::value;
  __shared__ float sh[32];
  const int nvec = p.cols / VEC;
  float w[ITERS][VEC], dw[ITERS][VEC], db[ITERS][VEC];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int iv = threadIdx.x + it * blockDim.x;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      w[it][j] = iv < nvec ? load_as_float(p.weight, iv * VEC + j, p.param_dtype) : 0.f;
      dw[it][j] = 0.f;
      db[it][j] = 0.f;
    }
  }
  const float inv_c = 1.f / static_cast<float>(p.cols);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t off = row * p.cols;
    const float mean = RMS ? 0.f : p.mean[row], rstd = p.rstd[row];
    float xh[ITERS][VEC], g[ITERS][VEC];
    float a1 = 0.f, a2 = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int iv = threadIdx.x + it * blockDim.x;
      if (iv >= nvec) continue;
      const Pack<T, VEC> sp = reinterpret_cast<const Pack<T, VEC>*>(static_cast<const T*>(p.sum) + off)[iv];
      const Pack<T, VEC> gp = reinterpret_cast<const Pack<T, VEC>*>(static_cast<const T*>(p.dy) + off)[iv];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float dy = to_f(gp.v[j]);
        xh[it][j] = (to_f(sp.v[j]) - mean) * rstd;
        g[it][j] = dy * w[it][j];
        a1 += g[it][j] * xh[it][j];
        if (RMS) {
          dw[it][j] += dy * to_f(from_f<T>(xh[it][j]));
          continue;
        }
        a2 += g[it][j];
        dw[it][j] += dy * xh[it][j];
        db[it][j] += dy;
      }
    }
    const float c1 = block_sum(a1, sh) * inv_c;
    const float c2 = RMS ? 0.f : block_sum(a2, sh) * inv_c;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int iv = threadIdx.x + it * blockDim.x;
      if (iv >= nvec) continue;
      Pack<T, VEC> rp;
      if (p.dsum) rp = reinterpret_cast<const Pack<T, VEC>*>(static_cast<const T*>(p.dsum) + off)[iv];
      Pack<T, VEC> op;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float o = (g[it][j] - c2 - xh[it][j] * c1) * rstd;
        if (p.dsum) o += to_f(rp.v[j]);
        op.v[j] = from_f<T>(o);
      }
      reinterpret_cast<Pack<T, VEC>*>(static_cast<T*>(p.dx) + off)[iv] = op;
    }
  }
  // Partials: [grid][cols] for dweight, then [grid][cols] for dbias.
  float* pw = p.workspace + static_cast<int64_t>(blockIdx.x) * p.cols;
  float* pb = p.workspace + (static_cast<int64_t>(gridDim.x) + blockIdx.x) * p.cols;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int iv = threadIdx.x + it * blockDim.x;
    if (iv >= nvec) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      pw[iv * VEC + j] = dw[it][j];
      if (!RMS) pb[iv * VEC + j] = db[it][j];
    }
  }
}

// out[c] = sum over g of part[g][c] in a fixed order; blockIdx.y selects dweight (0) / dbias (1).
__global__ void __launch_bounds__(256) ln_param_reduce_kernel(const float* __restrict__ part, int groups, int cols,
                                                              float* __restrict__ dw, float* __restrict__ db) {
  __shared__ float sh[8][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  const float* src = part + static_cast<int64_t>(blockIdx.y) * groups * cols;
  float acc = 0.f;
  if (c < cols)
    for (int g = threadIdx.y; g < groups; g += 8) acc += src[static_cast<int64_t>(g) * cols + c];
  sh[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) t += sh[i][threadIdx.x];
    (blockIdx.y == 0 ? dw : db)[c] = t;
  }
}

int elem_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }
int vec_width(DType d) { return 16 / elem_size(d); }

// Vector width for `cols`: 16-byte vectors when every row start is 16-byte aligned (cols a multiple
// of the width and every base pointer aligned), else scalars. Depends on the pointers only through
// alignment; fresh allocations always take the vector path.
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
int pick_vec(int cols, DType d, std::initializer_list<const void*> ptrs = {}) {
  if (cols % vec_width(d) != 0) return 1;
  for (const void* p : ptrs)
    if (!aligned16(p)) return 1;
  return vec_width(d);
}

int threads_for(int cols, int vec) {
  const int nvec = cols / vec;
  const int iters = vec == 1 ? 4 : 1;
  const int t = (nvec + iters - 1) / iters;
  return std::min(1024, std::max(32, (t + 31) / 32 * 32));
}

int64_t bwd_groups(int64_t rows, int cols, DType d) {
  const int threads = threads_for(cols, pick_vec(cols, d));
  return std::max<int64_t>(1, std::min<int64_t>(rows, 131072 / threads));
}

template <typename T>
cudaError_t launch_fwd(const LayerNormFwdParams& p, int vec, cudaStream_t stream) {
  const int threads = threads_for(p.cols, vec);
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (p.rms) {
    if (vec == 1) ln_fwd_kernel<T, 1, true><<<grid, threads, 0, stream>>>(p);
    else ln_fwd_kernel<T, 16 / sizeof(T), true><<<grid, threads, 0, stream>>>(p);
  } else {
    if (vec == 1) ln_fwd_kernel<T, 1, false><<<grid, threads, 0, stream>>>(p);
    else ln_fwd_kernel<T, 16 / sizeof(T), false><<<grid, threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const LayerNormBwdParams& p, int vec, int64_t groups, cudaStream_t stream) {
  const int threads = threads_for(p.cols, vec);
  const dim3 grid(static_cast<unsigned>(groups));
  if (p.rms) {
    if (vec == 1) ln_bwd_kernel<T, 1, true><<<grid, threads, 0, stream>>>(p);
    else ln_bwd_kernel<T, 16 / sizeof(T), true><<<grid, threads, 0, stream>>>(p);
  } else {
    if (vec == 1) ln_bwd_kernel<T, 1, false><<<grid, threads, 0, stream>>>(p);
    else ln_bwd_kernel<T, 16 / sizeof(T), false><<<grid, threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

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

int layer_norm_max_cols() { return 4096; }

cudaError_t layer_norm_fwd(const LayerNormFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const int vec = pick_vec(p.cols, p.dtype, {p.x, p.delta, p.sum, p.y});
  switch (p.dtype) {
    case DType::kFloat32: return launch_fwd<float>(p, vec, stream);
    case DType::kFloat16: return launch_fwd<__half>(p, vec, stream);
    case DType::kBFloat16: return launch_fwd<__nv_bfloat16>(p, vec, stream);
    default: return cudaErrorInvalidValue;
  }
}

int64_t layer_norm_bwd_workspace(int64_t rows, int cols, DType dtype) {
  return 2 * bwd_groups(rows, cols, dtype) * static_cast<int64_t>(cols);
}

cudaError_t layer_norm_bwd(const LayerNormBwdParams& p, cudaStream_t stream) {
  const int vec = pick_vec(p.cols, p.dtype, {p.dy, p.dsum, p.sum, p.dx});
  const int64_t groups = bwd_groups(p.rows, p.cols, p.dtype);
  if (p.rows == 0) {
    // No rows: zero parameter gradients.
    cudaError_t e = cudaMemsetAsync(p.dweight, 0, sizeof(float) * p.cols, stream);
    if (e == cudaSuccess && p.dbias) e = cudaMemsetAsync(p.dbias, 0, sizeof(float) * p.cols, stream);
    return e;
  }
  cudaError_t e;
  switch (p.dtype) {
    case DType::kFloat32: e = launch_bwd<float>(p, vec, groups, stream); break;
    case DType::kFloat16: e = launch_bwd<__half>(p, vec, groups, stream); break;
    case DType::kBFloat16: e = launch_bwd<__nv_bfloat16>(p, vec, groups, stream); break;
    default: return cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return e;
  const dim3 grid((p.cols + 31) / 32, p.dbias && !p.rms ? 2 : 1);
  ln_param_reduce_kernel<<<grid, dim3(32, 8), 0, stream>>>(p.workspace, static_cast<int>(groups), p.cols,
                                                           p.dweight, p.dbias);
  return cudaGetLastError();
}

cudaError_t cross_entropy_fwd(const CrossEntropyFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32: ce_fwd_kernel<float><<<ce_grid(p), 256, 0, stream>>>(p); break;
    case DType::kFloat16: ce_fwd_kernel<__half><<<ce_grid(p), 256, 0, stream>>>(p); break;
    case DType::kBFloat16: ce_fwd_kernel<__nv_bfloat16><<<ce_grid(p), 256, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t cross_entropy_bwd(const CrossEntropyBwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32: ce_bwd_kernel<float><<<ce_grid(p), 256, 0, stream>>>(p); break;
    case DType::kFloat16: ce_bwd_kernel<__half><<<ce_grid(p), 256, 0, stream>>>(p); break;
    case DType::kBFloat16: ce_bwd_kernel<__nv_bfloat16><<<ce_grid(p), 256, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t cross_entropy_rows(const CrossEntropyRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32: return launch_ce_rows<float>(p, stream);
    case DType::kFloat16: return launch_ce_rows<__half>(p, stream);
    case DType::kBFloat16: return launch_ce_rows<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t scale_by_device_scalar(const void* x, DType x_dtype, void* y, DType y_dtype, int64_t n, const float* scale,
                                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (x_dtype == y_dtype) {
    switch (x_dtype) {
      case DType::kFloat32: return launch_scale<float, float>(x, y, n, scale, stream);
      case DType::kFloat16: return launch_scale<__half, __half>(x, y, n, scale, stream);
      case DType::kBFloat16: return launch_scale<__nv_bfloat16, __nv_bfloat16>(x, y, n, scale, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  if (x_dtype != DType::kFloat32) return cudaErrorInvalidValue;
  switch (y_dtype) {
    case DType::kFloat16: return launch_scale<float, __half>(x, y, n, scale, stream);
    case DType::kBFloat16: return launch_scale<float, __nv_bfloat16>(x, y, n, scale, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace strobe::ops::cuda
