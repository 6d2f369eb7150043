// Float8 quantization with tensorwise dynamic scaling (launchers in fp8.h). Two kernels:
//   amax: one read of x, the maximum of |x| as the bits of a non-negative float (abs_bits, common.cuh):
//         a block reduction, then one atomicMax per block. Skipped when the caller gives the amax (a
//         producer kernel wrote it with x: swiglu's).
//   cast: a second read of x in tiles; each tile is written to q as read and, through shared memory,
//         transposed to q_t, so both copies come from one read.
// Three versions (docs/PERFORMANCE.md, "Float8 quantization"):
//   v3, where x is 16-byte aligned, cols % 8 == 0 and (without q_t, or rows % 16 == 0): v2 with a
//       swizzled tile whose transposed stores are whole 64-byte runs, and the column sums of x when
//       asked (a float8 linear's bias gradient) from the same read;
//   v2 (kept for bench/ops/fp8_cast_bench.cu; v3 replaced it): 16-byte loads (8 elements a thread), two
//       conversions per instruction, 64 x 64 tiles, 8-byte stores to q and 16-byte stores to q_t, a
//       warp's 32 q_t stores into 32 different rows;
//   v1, every other shape: one element a thread, 32 x 32 tiles, byte stores.
// The cast is the saturating, round-to-nearest-even conversion of cuda_fp8.h (__NV_SATFINITE): the
// same value as clamping to +-fp8_max and converting, which is what the CPU implementation does.
#include <cuda_fp8.h>

#include <algorithm>

#include "strobe/ops/cuda/common.cuh"
#include "strobe/ops/cuda/fp8.h"

namespace strobe::ops::cuda {
namespace {

constexpr int kAmaxThreads = 256;
constexpr int kTile = 32;
constexpr int kTileRows = 8;  // threads per tile column: each thread converts kTile / kTileRows rows
constexpr float kMinAmax = 1e-12f;

template <typename T>
__global__ void __launch_bounds__(kAmaxThreads) amax_kernel(const T* __restrict__ x, int64_t n, unsigned* __restrict__ amax) {
  unsigned m = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kAmaxThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kAmaxThreads)
    m = max(m, abs_bits(to_f(x[i])));
  block_amax_to<kAmaxThreads>(m, amax);
}

// v2: 8 elements a thread (16-byte loads), two chunks in flight before the first is reduced.
template <typename T>
__global__ void __launch_bounds__(kAmaxThreads) amax_v2_kernel(const T* __restrict__ x, int64_t n, unsigned* __restrict__ amax) {
  unsigned m = 0;
  const int64_t chunks = n / 8, stride = static_cast<int64_t>(gridDim.x) * kAmaxThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kAmaxThreads + threadIdx.x;
  for (; i + stride < chunks; i += 2 * stride) {
    float a[8], b[8];
    Vec8<T>::load(x + i * 8, a);
    Vec8<T>::load(x + (i + stride) * 8, b);
#pragma unroll
    for (int k = 0; k < 8; ++k) m = max(m, max(abs_bits(a[k]), abs_bits(b[k])));
  }
  if (i < chunks) {
    float a[8];
    Vec8<T>::load(x + i * 8, a);
#pragma unroll
    for (int k = 0; k < 8; ++k) m = max(m, abs_bits(a[k]));
  }
  for (int64_t t = chunks * 8 + static_cast<int64_t>(blockIdx.x) * kAmaxThreads + threadIdx.x; t < n; t += stride)
    m = max(m, abs_bits(to_f(x[t])));
  block_amax_to<kAmaxThreads>(m, amax);
}

template <Fp8Format F>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2));
}

template <Fp8Format F>
__device__ __forceinline__ float fp8_max() {
  return F == Fp8Format::kE4M3 ? 448.f : 57344.f;
}

// scale = fp8_max / max(amax, 1e-12), a NaN amax kept.
template <Fp8Format F>
__device__ __forceinline__ float scale_of(float amax) {
  const float a = isnan(amax) ? amax : fmaxf(amax, kMinAmax);
  return __fdiv_rn(fp8_max<F>(), a);
}

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kTile* kTileRows) cast_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                                                 const float* __restrict__ amax, uint8_t* __restrict__ q,
                                                                 uint8_t* __restrict__ q_t, float* __restrict__ scale_inv) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const float scale = scale_of<F>(*amax);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *scale_inv = __frcp_rn(scale);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c = c0 + threadIdx.x;
#pragma unroll
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const int64_t r = r0 + j;
    if (r < rows && c < cols) {
      const uint8_t v = to_fp8<F>(__fmul_rn(to_f(x[r * cols + c]), scale));
      q[r * cols + c] = v;
      tile[j][threadIdx.x] = v;
    }
  }
  if (q_t == nullptr) return;
  __syncthreads();
  // q_t[c][r] = q[r][c]: thread x now walks the tile's rows, so a warp writes 32 consecutive bytes.
  const int64_t tr = r0 + threadIdx.x;
#pragma unroll
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const int64_t tc = c0 + j;
    if (tr < rows && tc < cols) q_t[tc * rows + tr] = tile[threadIdx.x][j];
  }
}

// v2 cast: a 64 x 64 tile, 256 threads. Each thread converts two 8-element row chunks (both loads
// issued first) and stores 8 bytes of q per chunk and into the shared tile; then each thread gathers
// 16 rows of one tile column (a warp reads 32 consecutive bytes of a row at a time: no bank
// conflict) and writes them as 16 consecutive bytes of one q_t row.
constexpr int kV2Tile = 64;
constexpr int kV2Threads = 256;

template <Fp8Format F>
__device__ __forceinline__ uint2 to_fp8x8(const float (&v)[8], float scale) {
  const auto interp = F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  unsigned w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[2 * k], scale), __fmul_rn(v[2 * k + 1], scale)),
                                    __NV_SATFINITE, interp);
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kV2Threads) cast_v2_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                                              const float* __restrict__ amax, uint8_t* __restrict__ q,
                                                              uint8_t* __restrict__ q_t, float* __restrict__ scale_inv) {
  __shared__ alignas(16) uint8_t tile[kV2Tile][kV2Tile];
  const float scale = scale_of<F>(*amax);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = __frcp_rn(scale);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kV2Tile, c0 = static_cast<int64_t>(blockIdx.x) * kV2Tile;
  const int tc = (threadIdx.x & 7) * 8, tr = threadIdx.x >> 3;  // 8 threads a row, 32 rows a pass
  const int64_t c = c0 + tc;
  const bool in[2] = {r0 + tr < rows && c < cols, r0 + tr + 32 < rows && c < cols};
  float v[2][8];
#pragma unroll
  for (int p = 0; p < 2; ++p)
    if (in[p]) Vec8<T>::load(x + (r0 + tr + 32 * p) * cols + c, v[p]);
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    if (!in[p]) continue;
    const int j = tr + 32 * p;
    const uint2 out = to_fp8x8<F>(v[p], scale);
    *reinterpret_cast<uint2*>(q + (r0 + j) * cols + c) = out;
    *reinterpret_cast<uint2*>(&tile[j][tc]) = out;
  }
  if (q_t == nullptr) return;
  __syncthreads();
  // q_t[c][r] = q[r][c]: thread t gathers column t % 64 of the tile's rows 16 * (t / 64) .. + 15.
  const int oc = threadIdx.x & 63, band = threadIdx.x >> 6;
  const int64_t tcol = c0 + oc, trow = r0 + band * 16;
  if (tcol < cols && trow < rows) {  // rows % 16 == 0: the whole 16-row chunk is there
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = band * 16 + 4 * k;
      w[k] = tile[r][oc] | (tile[r + 1][oc] << 8) | (tile[r + 2][oc] << 16) |
             (static_cast<unsigned>(tile[r + 3][oc]) << 24);
    }
    *reinterpret_cast<uint4*>(q_t + tcol * rows + trow) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// v3 cast: v2's loads and q stores; the tile is kept swizzled in shared memory (row j's 8-byte unit u at
// unit u ^ (j / 16 % 4)) so that the transposed stores can be whole 64-byte runs: thread t writes the
// 16 bytes of tile rows 16 * (t % 4) .. + 15 of column t / 4, and a warp writes 8 full 64-byte q_t
// segments (v2's warp wrote 16 bytes into each of 32 segments). The swizzle keeps the byte gathers
// free of bank conflicts (a warp's 4 row bands read 4 different units). With col_part, each block also
// writes the fp32 sums of its 64 rows of x for each of its columns (col_part[tile row][col], a fixed
// order: warp shuffles over the 4 rows a warp holds, then the 8 warps in turn), which col_sums_kernel
// adds up: the bias gradient of a float8 linear from the read its cast makes anyway.
constexpr int kV3Tile = 64;
constexpr int kV3Threads = 256;

__device__ __forceinline__ int v3_unit(int row, int unit) { return unit ^ ((row >> 4) & 3); }

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kV3Threads) cast_v3_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                                              const float* __restrict__ amax, uint8_t* __restrict__ q,
                                                              uint8_t* __restrict__ q_t, float* __restrict__ scale_inv,
                                                              float* __restrict__ col_part) {
  __shared__ alignas(16) uint8_t tile[kV3Tile][kV3Tile];
  __shared__ float part[kV3Threads / 32][kV3Tile];
  const float scale = scale_of<F>(*amax);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = __frcp_rn(scale);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kV3Tile, c0 = static_cast<int64_t>(blockIdx.x) * kV3Tile;
  const int unit = threadIdx.x & 7, tc = unit * 8, tr = threadIdx.x >> 3;  // 8 threads a row, 32 rows a pass
  const int64_t c = c0 + tc;
  const bool in[2] = {r0 + tr < rows && c < cols, r0 + tr + 32 < rows && c < cols};
  float v[2][8];
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    if (in[p]) {
      Vec8<T>::load(x + (r0 + tr + 32 * p) * cols + c, v[p]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[p][k] = 0.f;
    }
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    if (!in[p]) continue;
    const int j = tr + 32 * p;
    const uint2 out = to_fp8x8<F>(v[p], scale);
    *reinterpret_cast<uint2*>(q + (r0 + j) * cols + c) = out;
    *reinterpret_cast<uint2*>(&tile[j][v3_unit(j, unit) * 8]) = out;
  }
  if (col_part != nullptr) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float s = v[0][k] + v[1][k];
      s += __shfl_xor_sync(0xffffffffu, s, 8);
      s += __shfl_xor_sync(0xffffffffu, s, 16);
      if (lane < 8) part[warp][tc + k] = s;
    }
  }
  if (q_t == nullptr && col_part == nullptr) return;
  __syncthreads();
  if (col_part != nullptr && threadIdx.x < kV3Tile && c0 + threadIdx.x < cols) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kV3Threads / 32; ++w) s += part[w][threadIdx.x];
    col_part[blockIdx.y * cols + c0 + threadIdx.x] = s;
  }
  if (q_t == nullptr) return;
  // q_t[c][r] = q[r][c]: thread t gathers tile column t / 4, rows 16 * (t % 4) .. + 15.
  const int oc = threadIdx.x >> 2, band = threadIdx.x & 3;
  const int64_t tcol = c0 + oc, trow = r0 + band * 16;
  if (tcol < cols && trow < rows) {  // rows % 16 == 0: the whole 16-row chunk is there
    const int off = (((oc >> 3) ^ band) << 3) | (oc & 7);  // every row of the band has the same swizzle
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = band * 16 + 4 * k;
      w[k] = tile[r][off] | (tile[r + 1][off] << 8) | (tile[r + 2][off] << 16) |
             (static_cast<unsigned>(tile[r + 3][off]) << 24);
    }
    *reinterpret_cast<uint4*>(q_t + tcol * rows + trow) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// sums[c] = the fp32 sum of col_part[0..tiles)[c], in a fixed order: a block of 32 columns x 32 threads,
// thread y adding tiles y, y + 32, ..., then thread y = 0 adding the 32 partial sums in turn.
constexpr int kSumCols = 32, kSumLanes = 32;

__global__ void __launch_bounds__(kSumCols* kSumLanes) col_sums_kernel(const float* __restrict__ col_part, int64_t tiles,
                                                                      int64_t cols, float* __restrict__ sums) {
  __shared__ float part[kSumLanes][kSumCols + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSumCols + threadIdx.x;
  float s = 0.f;
  if (c < cols)
    for (int64_t t = threadIdx.y; t < tiles; t += kSumLanes) s += col_part[t * cols + c];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  s = 0.f;
#pragma unroll
  for (int k = 0; k < kSumLanes; ++k) s += part[k][threadIdx.x];
  sums[c] = s;
}

// The column sums of any x (the shapes v3 does not take): one thread a column, rows in order.
template <typename T>
__global__ void col_sums_plain_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, float* __restrict__ sums) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.f;
  for (int64_t r = 0; r < rows; ++r) s += to_f(x[r * cols + c]);
  sums[c] = s;
}

// The shapes the 8-elements-a-thread kernels (v2, v3) take; v1 the rest.
bool use_tiled(const void* x, int64_t rows, int64_t cols, bool transpose) {
  return reinterpret_cast<uintptr_t>(x) % 16 == 0 && cols % 8 == 0 && (!transpose || rows % 16 == 0) &&
         (rows + kV2Tile - 1) / kV2Tile <= 65535;
}

template <typename T>
cudaError_t launch(const void* x, int64_t rows, int64_t cols, Fp8Format format, void* q, void* q_t, float* amax,
                   bool amax_given, float* scale_inv, float* col_sums, float* col_work, cudaStream_t stream) {
  const int64_t n = rows * cols;
  const bool v3 = use_tiled(x, rows, cols, q_t != nullptr);
  const auto* xs = static_cast<const T*>(x);
  if (!amax_given) {  // a producer's amax needs no pass over x before the cast
    cudaError_t e = cudaMemsetAsync(amax, 0, sizeof(float), stream);
    if (e != cudaSuccess) return e;
    auto* bits = reinterpret_cast<unsigned*>(amax);
    if (n > 0 && v3) {
      const int64_t blocks = std::min<int64_t>((n / 8 + kAmaxThreads - 1) / kAmaxThreads + 1, 132 * 8);
      amax_v2_kernel<T><<<static_cast<unsigned>(blocks), kAmaxThreads, 0, stream>>>(xs, n, bits);
    } else if (n > 0) {
      const int64_t blocks = std::min<int64_t>((n + kAmaxThreads - 1) / kAmaxThreads, 132 * 8);
      amax_kernel<T><<<static_cast<unsigned>(blocks), kAmaxThreads, 0, stream>>>(xs, n, bits);
    }
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  auto* qo = static_cast<uint8_t*>(q);
  auto* qt = static_cast<uint8_t*>(q_t);
  if (v3 && n > 0) {
    const int64_t tiles = (rows + kV3Tile - 1) / kV3Tile;
    const dim3 grid(static_cast<unsigned>((cols + kV3Tile - 1) / kV3Tile), static_cast<unsigned>(tiles));
    float* part = col_sums != nullptr ? col_work : nullptr;
    if (format == Fp8Format::kE4M3)
      cast_v3_kernel<T, Fp8Format::kE4M3><<<grid, kV3Threads, 0, stream>>>(xs, rows, cols, amax, qo, qt, scale_inv, part);
    else
      cast_v3_kernel<T, Fp8Format::kE5M2><<<grid, kV3Threads, 0, stream>>>(xs, rows, cols, amax, qo, qt, scale_inv, part);
    if (col_sums != nullptr) {
      cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
      col_sums_kernel<<<static_cast<unsigned>((cols + kSumCols - 1) / kSumCols), dim3(kSumCols, kSumLanes), 0, stream>>>(
          part, tiles, cols, col_sums);
    }
    return cudaGetLastError();
  }
  if (col_sums != nullptr) {
    if (cols > 0 && rows > 0) {
      col_sums_plain_kernel<T><<<static_cast<unsigned>((cols + 255) / 256), 256, 0, stream>>>(xs, rows, cols, col_sums);
    } else if (cols > 0) {
      cudaError_t e = cudaMemsetAsync(col_sums, 0, cols * sizeof(float), stream);
      if (e != cudaSuccess) return e;
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  // One block at least, so scale_inv is written for an empty tensor too.
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, (cols + kTile - 1) / kTile)),
                  static_cast<unsigned>(std::max<int64_t>(1, (rows + kTile - 1) / kTile)));
  const dim3 block(kTile, kTileRows);
  if (grid.y > 65535) return cudaErrorInvalidValue;
  if (format == Fp8Format::kE4M3)
    cast_kernel<T, Fp8Format::kE4M3><<<grid, block, 0, stream>>>(xs, rows, cols, amax, qo, qt, scale_inv);
  else
    cast_kernel<T, Fp8Format::kE5M2><<<grid, block, 0, stream>>>(xs, rows, cols, amax, qo, qt, scale_inv);
  return cudaGetLastError();
}

}  // namespace

cudaError_t fp8_quantize(const void* x, int64_t rows, int64_t cols, DType dtype, Fp8Format format, void* q, void* q_t,
                         float* amax, bool amax_given, float* scale_inv, float* col_sums, float* col_work,
                         cudaStream_t stream) {
  return dispatch_float(dtype, [&](auto t) {
    return launch<typename decltype(t)::type>(x, rows, cols, format, q, q_t, amax, amax_given, scale_inv, col_sums,
                                              col_work, stream);
  });
}

int64_t fp8_col_work_floats(const void* x, int64_t rows, int64_t cols, bool transpose) {
  return use_tiled(x, rows, cols, transpose) ? (rows + kV3Tile - 1) / kV3Tile * cols : 0;
}

}  // namespace strobe::ops::cuda
