// Fused conv3x3 (padding 1) + max-pool 2x2 + ReLU, forward and backward, for thin channel counts
// (the face detector's 1->4->16->64 stages). Direct convolution on CUDA cores in fp32: at these
// channel counts the stages are memory-bound and tensor-core tiles would sit mostly empty.
//   forward: one thread per pooled pixel and COB output channels (its 2x2 conv outputs from a 4x4
//            input patch per input channel); writes y and the 1-byte mask (argmax | relu bit).
//   grad_x:  one thread per 2x2 input block and CIB input channels; rebuilds the 4x4 window of the
//            conv-output gradient from the 3x3 pooled neighbours' masks (the gradient is non-zero
//            only at each window's argmax) and applies the transposed 3x3 taps.
//   grad_w:  blocks own (output-channel chunk, set of tiles); per tile the input (with halo) and
//            the masked pooled gradient sit in shared memory; each thread owns one (co, ci) pair and
//            sums only over the argmax positions (a quarter of the dense work). Per-block partial
//            sums, reduced in a fixed order by a second kernel: deterministic, no atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "strobe/ops/cuda/common.cuh"
#include "strobe/ops/cuda/conv_pool.h"

namespace strobe::ops::cuda {
namespace {

// ---- forward ------------------------------------------------------------------------------------
constexpr int kFwdThreads = 128;
constexpr int kFwdCiChunk = 16;  // input channels whose weights are staged in shared memory at once

template <int COB>
__global__ void __launch_bounds__(kFwdThreads)
    fwd_kernel(const void* __restrict__ x, DType xdt, float xs,
               const float* __restrict__ wt, const float* __restrict__ bias, void* __restrict__ y,
               DType ydt, uint8_t* __restrict__ mask, ConvPoolShape s) {
  // [ci][co][12]: the 9 taps padded to 12 so each (ci, co) is three aligned float4 loads.
  __shared__ float4 sw[kFwdCiChunk * COB * 3];
  const int ho = s.h / 2, wo = s.w / 2;
  const int pix = blockIdx.x * kFwdThreads + threadIdx.x;
  const bool valid = pix < ho * wo;
  const int64_t n = blockIdx.y;
  const int co0 = blockIdx.z * COB;
  const int po = valid ? pix / wo : 0, qo = valid ? pix % wo : 0;
  const int r0 = 2 * po - 1, c0 = 2 * qo - 1;
  const int64_t plane = static_cast<int64_t>(s.h) * s.w;

  float acc[COB][4];
#pragma unroll
  for (int co = 0; co < COB; ++co) {
    const float b = bias[co0 + co];
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[co][k] = b;
  }
  float* swf = reinterpret_cast<float*>(sw);
  for (int ci0 = 0; ci0 < s.cin; ci0 += kFwdCiChunk) {
    const int nci = min(kFwdCiChunk, s.cin - ci0);
    __syncthreads();
    for (int i = threadIdx.x; i < nci * COB * 12; i += kFwdThreads) {
      const int tap = i % 12, co = (i / 12) % COB, ci = i / (12 * COB);
      swf[i] = tap < 9 ? wt[(static_cast<int64_t>(co0 + co) * s.cin + ci0 + ci) * 9 + tap] : 0.f;
    }
    __syncthreads();
    if (!valid) continue;
    for (int ci = 0; ci < nci; ++ci) {
      const int64_t base = (n * s.cin + ci0 + ci) * plane;
      float v[4][4];
#pragma unroll
      for (int dy = 0; dy < 4; ++dy) {
        const int r = r0 + dy;
        const bool rok = r >= 0 && r < s.h;
#pragma unroll
        for (int dx = 0; dx < 4; ++dx) {
          const int c = c0 + dx;
          v[dy][dx] = (rok && c >= 0 && c < s.w)
                          ? load_as_float(x, base + static_cast<int64_t>(r) * s.w + c, xdt) * xs
                          : 0.f;
        }
      }
#pragma unroll
      for (int co = 0; co < COB; ++co) {
        const float4 w0 = sw[(ci * COB + co) * 3], w1 = sw[(ci * COB + co) * 3 + 1],
                     w2 = sw[(ci * COB + co) * 3 + 2];
        const float w[9] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w, w2.x};
#pragma unroll
        for (int a = 0; a < 2; ++a) {
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            float t = acc[co][a * 2 + b];
#pragma unroll
            for (int ky = 0; ky < 3; ++ky) {
#pragma unroll
              for (int kx = 0; kx < 3; ++kx) t = fmaf(v[a + ky][b + kx], w[ky * 3 + kx], t);
            }
            acc[co][a * 2 + b] = t;
          }
        }
      }
    }
  }
  if (!valid) return;
#pragma unroll
  for (int co = 0; co < COB; ++co) {
    // PyTorch's max-pool rule: the first maximum in row-major order wins; NaN propagates.
    float m = acc[co][0];
    int am = 0;
#pragma unroll
    for (int k = 1; k < 4; ++k) {
      const float t = acc[co][k];
      if (t > m || isnan(t)) {
        m = t;
        am = k;
      }
    }
    const float out = m > 0.f ? m : (isnan(m) ? m : 0.f);
    const int64_t o = ((n * s.cout + co0 + co) * ho + po) * wo + qo;
    store_from_float(y, o, out, ydt);
    // ReLU's backward passes the gradient where !(y <= 0) (threshold_backward on the result).
    mask[o] = static_cast<uint8_t>(am | (m <= 0.f ? 0 : 4));
  }
}

// ---- grad_x -------------------------------------------------------------------------------------
constexpr int kBwdThreads = 128;
constexpr int kBwdCoChunk = 32;  // output channels whose weights are staged at once

template <int CIB>
__global__ void __launch_bounds__(kBwdThreads)
    bwd_input_kernel(const void* __restrict__ gy, DType gydt,
                     const uint8_t* __restrict__ mask, const float* __restrict__ wt, float xs,
                     void* __restrict__ gx, DType gxdt, ConvPoolShape s) {
  __shared__ float4 sw[kBwdCoChunk * CIB * 3];  // [co][ci][12]
  const int ho = s.h / 2, wo = s.w / 2;
  const int hb = (s.h + 1) / 2, wb = (s.w + 1) / 2;
  const int blk = blockIdx.x * kBwdThreads + threadIdx.x;
  const bool valid = blk < hb * wb;
  const int bq = valid ? blk / wb : 0, br = valid ? blk % wb : 0;
  const int64_t n = blockIdx.y;
  const int ci0 = blockIdx.z * CIB;

  float acc[CIB][4];
#pragma unroll
  for (int ci = 0; ci < CIB; ++ci) {
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[ci][k] = 0.f;
  }
  float* swf = reinterpret_cast<float*>(sw);
  for (int co0 = 0; co0 < s.cout; co0 += kBwdCoChunk) {
    const int nco = min(kBwdCoChunk, s.cout - co0);
    __syncthreads();
    for (int i = threadIdx.x; i < nco * CIB * 12; i += kBwdThreads) {
      const int tap = i % 12, ci = (i / 12) % CIB, co = i / (12 * CIB);
      swf[i] = tap < 9 ? wt[(static_cast<int64_t>(co0 + co) * s.cin + ci0 + ci) * 9 + tap] : 0.f;
    }
    __syncthreads();
    if (!valid) continue;
    for (int co = 0; co < nco; ++co) {
      const int64_t pbase = (n * s.cout + co0 + co) * ho * wo;
      // The 3x3 pooled neighbours: gradient (0 where the ReLU blocks) and argmax (-1: none).
      float g[3][3];
      int am[3][3];
#pragma unroll
      for (int dy = 0; dy < 3; ++dy) {
#pragma unroll
        for (int dx = 0; dx < 3; ++dx) {
          const int pr = bq + dy - 1, pc = br + dx - 1;
          g[dy][dx] = 0.f;
          am[dy][dx] = -1;
          if (pr >= 0 && pr < ho && pc >= 0 && pc < wo) {
            const int64_t o = pbase + static_cast<int64_t>(pr) * wo + pc;
            const int m = mask[o];
            if (m & 4) {
              g[dy][dx] = load_as_float(gy, o, gydt);
              am[dy][dx] = m & 3;
            }
          }
        }
      }
      // Conv-output gradient over rows/cols 2*bq-1 .. 2*bq+2: cell U lies in pooled neighbour
      // (U+1)/2 at sub-row (U+1)&1.
      float gz[4][4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int py = (u + 1) / 2, px = (v + 1) / 2;
          const int sub = ((u + 1) & 1) * 2 + ((v + 1) & 1);
          gz[u][v] = am[py][px] == sub ? g[py][px] : 0.f;
        }
      }
#pragma unroll
      for (int ci = 0; ci < CIB; ++ci) {
        const float4 w0 = sw[(co * CIB + ci) * 3], w1 = sw[(co * CIB + ci) * 3 + 1],
                     w2 = sw[(co * CIB + ci) * 3 + 2];
        const float w[9] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w, w2.x};
#pragma unroll
        for (int a = 0; a < 2; ++a) {
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            float t = acc[ci][a * 2 + b];
#pragma unroll
            for (int ky = 0; ky < 3; ++ky) {
#pragma unroll
              for (int kx = 0; kx < 3; ++kx) t = fmaf(gz[a - ky + 2][b - kx + 2], w[ky * 3 + kx], t);
            }
            acc[ci][a * 2 + b] = t;
          }
        }
      }
    }
  }
  if (!valid) return;
#pragma unroll
  for (int ci = 0; ci < CIB; ++ci) {
#pragma unroll
    for (int a = 0; a < 2; ++a) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int i = 2 * bq + a, j = 2 * br + b;
        if (i < s.h && j < s.w) {
          store_from_float(gx, ((n * s.cin + ci0 + ci) * s.h + i) * s.w + j, acc[ci][a * 2 + b] * xs, gxdt);
        }
      }
    }
  }
}

// ---- grad_w, grad_b -----------------------------------------------------------------------------
constexpr int kWgThreads = 256;
constexpr int kWgMaxCin = 64;

struct WgradPlan {
  int cc = 0;  // output channels per block (cc * cin <= kWgThreads)
  int tp = 0;  // pooled tile side
  int rows = 0;  // input tile side with halo: 2 * tp + 2
  int ps = 0;  // shared plane stride (odd: channels of one warp fall in different banks)
  int tiles_y = 0, tiles_x = 0;
  int64_t tiles = 0;
  int gx = 0, gy = 0;
  int64_t entries = 0;  // cout * cin * 10 (9 taps + bias)
  size_t smem = 0;
};

WgradPlan wgrad_plan(const ConvPoolShape& s) {
  WgradPlan p;
  if (s.cin < 1 || s.cin > kWgMaxCin || s.cout < 1) return p;
  for (int d = std::min(16, kWgThreads / s.cin); d >= 1; --d) {
    if (s.cout % d == 0) {
      p.cc = d;
      break;
    }
  }
  p.tp = s.cin <= 1 ? 32 : s.cin <= 4 ? 16 : s.cin <= 16 ? 8 : 4;
  p.rows = 2 * p.tp + 2;
  p.ps = p.rows * p.rows + 1;
  const int ho = s.h / 2, wo = s.w / 2;
  p.tiles_y = (ho + p.tp - 1) / p.tp;
  p.tiles_x = (wo + p.tp - 1) / p.tp;
  p.tiles = s.n * p.tiles_y * p.tiles_x;
  p.gy = s.cout / p.cc;
  p.entries = static_cast<int64_t>(s.cout) * s.cin * 10;
  const int64_t cap = std::max<int64_t>(32, (int64_t{1} << 22) / p.entries);
  p.gx = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({p.tiles, 512, cap})));
  const size_t tile = sizeof(float) * (static_cast<size_t>(s.cin) * p.ps + p.cc * p.tp * p.tp) +
                      static_cast<size_t>(p.cc) * p.tp * p.tp;
  p.smem = std::max(tile, sizeof(float) * kWgThreads * 10);
  return p;
}

__global__ void __launch_bounds__(kWgThreads)
    wgrad_kernel(const void* __restrict__ gy, DType gydt, const uint8_t* __restrict__ mask,
                 const void* __restrict__ x, DType xdt, float xs,
                 float* __restrict__ partial, ConvPoolShape s, WgradPlan p) {
  extern __shared__ float smem[];
  float* sx = smem;
  float* sg = sx + s.cin * p.ps;
  uint8_t* sa = reinterpret_cast<uint8_t*>(sg + p.cc * p.tp * p.tp);
  const int tid = threadIdx.x;
  const int pairs = p.cc * s.cin, lanes = kWgThreads / pairs;
  const int pair = tid % pairs, lane = tid / pairs;
  const bool active = lane < lanes;
  const int co_l = pair / s.cin, ci = pair % s.cin;
  const int co0 = blockIdx.y * p.cc;
  const int ho = s.h / 2, wo = s.w / 2, tpp = p.tp * p.tp, rows = p.rows;
  const int64_t per_image = static_cast<int64_t>(p.tiles_y) * p.tiles_x;

  float acc[10];
#pragma unroll
  for (int k = 0; k < 10; ++k) acc[k] = 0.f;
  for (int64_t tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const int64_t n = tile / per_image;
    const int rem = static_cast<int>(tile % per_image);
    const int py0 = (rem / p.tiles_x) * p.tp, px0 = (rem % p.tiles_x) * p.tp;
    const int xr0 = 2 * py0 - 1, xc0 = 2 * px0 - 1;
    __syncthreads();
    for (int i = tid; i < s.cin * rows * rows; i += kWgThreads) {
      const int c = i % rows, r = (i / rows) % rows, cc = i / (rows * rows);
      const int gr = xr0 + r, gc = xc0 + c;
      float v = 0.f;
      if (gr >= 0 && gr < s.h && gc >= 0 && gc < s.w) {
        v = load_as_float(x, ((n * s.cin + cc) * s.h + gr) * static_cast<int64_t>(s.w) + gc, xdt) * xs;
      }
      sx[cc * p.ps + r * rows + c] = v;
    }
    for (int i = tid; i < p.cc * tpp; i += kWgThreads) {
      const int pp = i % tpp, col = i / tpp;
      const int pr = py0 + pp / p.tp, pc = px0 + pp % p.tp;
      float g = 0.f;
      int a = 0;
      if (pr < ho && pc < wo) {
        const int64_t o = ((n * s.cout + co0 + col) * ho + pr) * static_cast<int64_t>(wo) + pc;
        const int m = mask[o];
        if (m & 4) g = load_as_float(gy, o, gydt);
        a = m & 3;
      }
      sg[i] = g;
      sa[i] = static_cast<uint8_t>(a);
    }
    __syncthreads();
    if (active) {
      for (int pp = lane; pp < tpp; pp += lanes) {
        const float g = sg[co_l * tpp + pp];
        const int a = sa[co_l * tpp + pp];
        const int u = 2 * (pp / p.tp) + (a >> 1), v = 2 * (pp % p.tp) + (a & 1);
        const float* xp = sx + ci * p.ps + u * rows + v;
#pragma unroll
        for (int ky = 0; ky < 3; ++ky) {
#pragma unroll
          for (int kx = 0; kx < 3; ++kx) acc[ky * 3 + kx] = fmaf(g, xp[ky * rows + kx], acc[ky * 3 + kx]);
        }
        acc[9] += g;
      }
    }
  }
  __syncthreads();
  float* red = smem;  // [lane][pair][10]
  if (active) {
#pragma unroll
    for (int k = 0; k < 10; ++k) red[(lane * pairs + pair) * 10 + k] = acc[k];
  }
  __syncthreads();
  for (int e = tid; e < pairs * 10; e += kWgThreads) {
    float sum = 0.f;
    for (int l = 0; l < lanes; ++l) sum += red[l * pairs * 10 + e];
    partial[blockIdx.x * p.entries + static_cast<int64_t>(co0) * s.cin * 10 + e] = sum;
  }
}

__global__ void wgrad_finalize(const float* __restrict__ partial, int blocks, int64_t entries,
                               int cin, float* __restrict__ gw, float* __restrict__ gb) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= entries) return;
  float sum = 0.f;
  for (int b = 0; b < blocks; ++b) sum += partial[b * entries + e];
  const int k = static_cast<int>(e % 10);
  const int64_t pair = e / 10;
  if (k < 9) {
    gw[pair * 9 + k] = sum;
  } else if (pair % cin == 0) {
    gb[pair / cin] = sum;
  }
}

int pick_block(int c) { return c % 16 == 0 ? 16 : c % 4 == 0 ? 4 : 1; }

}  // namespace

cudaError_t conv_pool_fwd(const void* x, DType x_dtype, float x_scale, const float* weight,
                          const float* bias, void* y, DType y_dtype, uint8_t* mask,
                          const ConvPoolShape& s, cudaStream_t stream) {
  const int64_t pix = static_cast<int64_t>(s.h / 2) * (s.w / 2);
  if (s.n == 0 || pix == 0) return cudaSuccess;
  if (s.n > 65535) return cudaErrorInvalidValue;
  const int cob = pick_block(s.cout);
  const dim3 grid(static_cast<unsigned>((pix + kFwdThreads - 1) / kFwdThreads),
                  static_cast<unsigned>(s.n), static_cast<unsigned>(s.cout / cob));
  switch (cob) {
    case 16:
      fwd_kernel<16><<<grid, kFwdThreads, 0, stream>>>(x, x_dtype, x_scale, weight, bias, y,
                                                       y_dtype, mask, s);
      break;
    case 4:
      fwd_kernel<4><<<grid, kFwdThreads, 0, stream>>>(x, x_dtype, x_scale, weight, bias, y, y_dtype,
                                                      mask, s);
      break;
    default:
      fwd_kernel<1><<<grid, kFwdThreads, 0, stream>>>(x, x_dtype, x_scale, weight, bias, y, y_dtype,
                                                      mask, s);
  }
  return cudaGetLastError();
}

cudaError_t conv_pool_bwd_input(const void* grad_y, DType gy_dtype, const uint8_t* mask,
                                const float* weight, float x_scale, void* grad_x,
                                DType gx_dtype, const ConvPoolShape& s,
                                cudaStream_t stream) {
  const int64_t blocks = static_cast<int64_t>((s.h + 1) / 2) * ((s.w + 1) / 2);
  if (s.n == 0 || blocks == 0) return cudaSuccess;
  if (s.n > 65535) return cudaErrorInvalidValue;
  const int cib = pick_block(s.cin);
  const dim3 grid(static_cast<unsigned>((blocks + kBwdThreads - 1) / kBwdThreads),
                  static_cast<unsigned>(s.n), static_cast<unsigned>(s.cin / cib));
  switch (cib) {
    case 16:
      bwd_input_kernel<16><<<grid, kBwdThreads, 0, stream>>>(grad_y, gy_dtype, mask, weight,
                                                             x_scale, grad_x, gx_dtype, s);
      break;
    case 4:
      bwd_input_kernel<4><<<grid, kBwdThreads, 0, stream>>>(grad_y, gy_dtype, mask, weight, x_scale,
                                                            grad_x, gx_dtype, s);
      break;
    default:
      bwd_input_kernel<1><<<grid, kBwdThreads, 0, stream>>>(grad_y, gy_dtype, mask, weight, x_scale,
                                                            grad_x, gx_dtype, s);
  }
  return cudaGetLastError();
}

int64_t conv_pool_wgrad_workspace(const ConvPoolShape& s) {
  const WgradPlan p = wgrad_plan(s);
  return p.cc == 0 ? 0 : static_cast<int64_t>(p.gx) * p.entries;
}

cudaError_t conv_pool_bwd_weight(const void* grad_y, DType gy_dtype, const uint8_t* mask,
                                 const void* x, DType x_dtype, float x_scale,
                                 float* workspace, float* grad_weight, float* grad_bias,
                                 const ConvPoolShape& s, cudaStream_t stream) {
  const WgradPlan p = wgrad_plan(s);
  if (p.cc == 0) return cudaErrorInvalidValue;
  if (p.tiles == 0) {
    cudaError_t e = cudaMemsetAsync(grad_weight, 0, sizeof(float) * s.cout * s.cin * 9, stream);
    if (e != cudaSuccess) return e;
    return cudaMemsetAsync(grad_bias, 0, sizeof(float) * s.cout, stream);
  }
  wgrad_kernel<<<dim3(p.gx, p.gy), kWgThreads, p.smem, stream>>>(grad_y, gy_dtype, mask, x, x_dtype,
                                                                  x_scale, workspace, s, p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  wgrad_finalize<<<static_cast<unsigned>((p.entries + 255) / 256), 256, 0, stream>>>(
      workspace, p.gx, p.entries, s.cin, grad_weight, grad_bias);
  return cudaGetLastError();
}

}  // namespace strobe::ops::cuda
