// Fused residual-add + LayerNorm / RMSNorm (forward, backward). Memory-bound kernels: the point is
// fewer passes over the activations, not arithmetic.
//   LayerNorm forward: one block per row; each thread keeps its elements of the row in registers
//     (16-byte vectors when cols allows), so the row is read once, the sum x + delta written once,
//     mean and variance taken in two passes over registers (no E[x^2] - E[x]^2 cancellation).
//   LayerNorm backward: a fixed grid of blocks strides over rows; per row dx in one pass, while
//     each thread accumulates its columns' dweight / dbias over the rows it visits. The per-block
//     partials are summed in a fixed order by a second kernel: deterministic, no atomics.
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
  unsigned m = 0;  // max |y| of this thread's elements, as abs_bits (p.y_amax)
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
    if (p.y_amax) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) m = max(m, abs_bits(to_f(yp.v[j])));
    }
  }
  if (threadIdx.x == 0) {
    if (p.mean) p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
  if (p.y_amax) block_amax_any(m, reinterpret_cast<unsigned*>(p.y_amax));
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

}  // namespace

int layer_norm_max_cols() { return 4096; }

cudaError_t layer_norm_fwd(const LayerNormFwdParams& p, cudaStream_t stream) {
  if (p.y_amax) {
    cudaError_t e = cudaMemsetAsync(p.y_amax, 0, sizeof(float), stream);
    if (e != cudaSuccess) return e;
  }
  if (p.rows == 0) return cudaSuccess;
  const int vec = pick_vec(p.cols, p.dtype, {p.x, p.delta, p.sum, p.y});
  return dispatch_float(p.dtype, [&](auto t) { return launch_fwd<typename decltype(t)::type>(p, vec, stream); });
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
  const cudaError_t e =
      dispatch_float(p.dtype, [&](auto t) { return launch_bwd<typename decltype(t)::type>(p, vec, groups, stream); });
  if (e != cudaSuccess) return e;
  const dim3 grid((p.cols + 31) / 32, p.dbias && !p.rms ? 2 : 1);
  ln_param_reduce_kernel<<<grid, dim3(32, 8), 0, stream>>>(p.workspace, static_cast<int>(groups), p.cols,
                                                           p.dweight, p.dbias);
  return cudaGetLastError();
}

}  // namespace strobe::ops::cuda
