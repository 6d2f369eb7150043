// Device building blocks shared by the flash-attention kernels: mma.sync m16n8k16 (bf16/fp16 in,
// fp32 accumulate), ldmatrix fragment loads from XOR-swizzled shared tiles, cp.async tile loads,
// and the per-sequence coordinates. Fragment layouts (g = lane / 4, t = lane % 4):
//   C (16x8 fp32): c0,c1 = (row g, cols 2t, 2t+1); c2,c3 = (row g+8, same cols).
//   A (16x16):     a0 = (g, k 2t..2t+1), a1 = (g+8, k 2t..), a2 = (g, k 2t+8..), a3 = (g+8, k 2t+8..).
//   B (16x8):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g).
// Two neighbouring C tiles converted to 16-bit are exactly one A fragment, so P and dS never leave
// registers on their way into the next matmul.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "strobe/ops/cuda/common.cuh"
#include "strobe/ops/cuda/flash_attention.h"

namespace strobe::ops::cuda::flash {

// The one switch from (dtype, head_dim) to the instantiations the kernels are built for:
// f(As<T>{}, std::integral_constant<int, D>{}) with T __nv_bfloat16 or __half and D 64 or 128;
// anything else (flash_attention_supported says no) is cudaErrorInvalidValue.
template <typename F>
inline cudaError_t dispatch(DType dtype, int head_dim, F&& f) {
  if (!flash_attention_supported(head_dim, dtype)) return cudaErrorInvalidValue;
  auto with_dim = [&](auto t) {
    return head_dim == 64 ? f(t, std::integral_constant<int, 64>{}) : f(t, std::integral_constant<int, 128>{});
  };
  return dtype == DType::kBFloat16 ? with_dim(As<__nv_bfloat16>{}) : with_dim(As<__half>{});
}

constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float c[4], const uint32_t a[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float c[4], const uint32_t a[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte async copy; src_bytes = 0 zero-fills the destination (rows past a sequence's end: the
// next sequence's rows, or past the allocation, are never read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Element offset of (row, col) in a [rows][D] shared tile whose 16-byte chunks are XOR-swizzled by
// row % 8: the 8 rows an ldmatrix phase reads then hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Element offset of (row, col) in the wgmma kernels' panel layout (flash_sm90.cuh): a [ROWS][D]
// tile as D / 64 panels of [ROWS][64], each 128-byte row's 16-byte chunks XOR-swizzled by row % 8.
// For D = 64 it equals swz<64>.
template <int ROWS>
__device__ __forceinline__ int pswz(int row, int col) {
  return (col >> 6) * ROWS * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

// Copy rows [0, ROWS) of a tile (row r at src + r * row_stride) into shared memory, laid out by
// swz<D> (or pswz<ROWS> with kPanels); rows >= valid are zero-filled. All NT threads of the block
// call it.
template <typename T, int ROWS, int D, int NT, bool kPanels = false>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t row_stride, int valid,
                                          int tid) {
  constexpr int kChunks = D / 8;
  static_assert((ROWS * kChunks) % NT == 0, "tile chunks must split evenly over threads");
#pragma unroll
  for (int i = 0; i < ROWS * kChunks / NT; ++i) {
    const int idx = tid + i * NT;
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const bool ok = r < valid;
    const int off = kPanels ? pswz<ROWS>(r, c) : swz<D>(r, c);
    cp_async16(smem_u32(dst + off), ok ? src + r * row_stride + c : src, ok);
  }
}

// A fragment (16x16) at (row0, k0) of a [rows][D] tile.
template <int D>
__device__ __forceinline__ void ld_a(uint32_t a[4], const void* tile, int row0, int k0, int lane) {
  const int r = row0 + (lane & 15), c = k0 + ((lane >> 4) << 3);
  ldsm_x4(a, smem_u32(static_cast<const uint16_t*>(tile) + swz<D>(r, c)));
}
// B fragments of two n8 tiles (n0.., n0+8..) for k0..k0+15 from a tile stored [n][k] (K-like):
// b[0], b[1] for the first tile, b[2], b[3] for the second.
template <int D>
__device__ __forceinline__ void ld_b_nk(uint32_t b[4], const void* tile, int n0, int k0,
                                        int lane) {
  const int r = n0 + (lane & 7) + ((lane >> 4) << 3), c = k0 + (((lane >> 3) & 1) << 3);
  ldsm_x4(b, smem_u32(static_cast<const uint16_t*>(tile) + swz<D>(r, c)));
}
// The same from a tile stored [k][n] (V-like), transposed by ldmatrix.
template <int D>
__device__ __forceinline__ void ld_b_kn(uint32_t b[4], const void* tile, int k0, int n0,
                                        int lane) {
  const int r = k0 + (lane & 7) + (((lane >> 3) & 1) << 3), c = n0 + ((lane >> 4) << 3);
  ldsm_x4_t(b, smem_u32(static_cast<const uint16_t*>(tile) + swz<D>(r, c)));
}

// Where one (batch, head) lives: row offsets and lengths of its q and k sequences.
struct SeqInfo {
  int q_start, seqlen_q, k_start, seqlen_k;
};
__device__ __forceinline__ SeqInfo seq_info(const FlashAttnParams& p, int b) {
  SeqInfo s;
  if (p.cu_seqlens_q != nullptr) {
    s.q_start = p.cu_seqlens_q[b];
    s.seqlen_q = p.cu_seqlens_q[b + 1] - s.q_start;
    s.k_start = p.cu_seqlens_k[b];
    s.seqlen_k = p.cu_seqlens_k[b + 1] - s.k_start;
  } else {
    s.q_start = 0;
    s.seqlen_q = p.seqlen_q;
    s.k_start = 0;
    s.seqlen_k = p.seqlen_k;
  }
  return s;
}
__device__ __forceinline__ int64_t row_base(const AttnStrides& st, int b, int start, int h) {
  return static_cast<int64_t>(b) * st.batch + static_cast<int64_t>(start) * st.row +
         static_cast<int64_t>(h) * st.head;
}
__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Number of key blocks query block m sees (blocks 0 .. n_end-1), causal bottom-right aligned.
__device__ __forceinline__ int key_block_end(int m_block, int br, int bc, const SeqInfo& s,
                                             bool causal) {
  int limit = s.seqlen_k;
  if (causal) limit = min(limit, (m_block + 1) * br + s.seqlen_k - s.seqlen_q);
  return limit <= 0 ? 0 : ceil_div(limit, bc);
}

template <int J>
__device__ __forceinline__ void zero_acc(float (&acc)[J][4]) {
#pragma unroll
  for (int j = 0; j < J; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
}

// Allow `bytes` of dynamic shared memory for a kernel (each launcher calls it once per kernel).
template <typename Kernel>
cudaError_t set_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// Write a warp's 16 x D fp32 accumulator rows (row0 + g, row0 + g + 8) as T, skipping rows >= valid.
template <typename T, int D>
__device__ __forceinline__ void store_rows(T* dst, int64_t row_stride, int row0, int valid,
                                           const float (*acc)[4], const float mul[2], int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + g + half * 8;
    if (r >= valid) continue;
    T* row = dst + r * row_stride;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<uint32_t*>(row + j * 8 + 2 * t) =
          pack2<T>(acc[j][2 * half] * mul[half], acc[j][2 * half + 1] * mul[half]);
    }
  }
}

}  // namespace strobe::ops::cuda::flash
