// Flash-attention forward, FlashAttention-2 style on mma.sync (kernel version v3; see
// docs/PERFORMANCE.md). One CTA of 4 warps owns a block of 16 * 4 * MT query rows of one (batch,
// head); each warp owns 16 * MT rows (MT m16 tiles, so every K / V fragment read from shared memory
// feeds MT mma's) and streams all 64-key blocks of K and V through double-buffered shared memory
// (cp.async), keeping Q, the running max / sum and the unnormalised O in registers (online softmax,
// exp2 with the scale folded in). P goes from the S accumulators straight into the A operand of
// P.V. Key blocks run from the highest down, so the blocks that need the causal / length mask come
// first and the rest skip it. On compute capability 9.0 flash_fwd_sm90.cu's v4 (wgmma) runs instead.
#include <cfloat>
#include <cmath>

#include "strobe/ops/cuda/flash_common.cuh"

namespace strobe::ops::cuda {
namespace flash {
namespace {

constexpr int kWarps = 4, kThreads = kWarps * 32, kBc = 64;

// m16 tiles per warp. head_dim 64: 2 (128-row CTAs; v1's 1 was 5-10% slower on every fixed-length
// row). head_dim 128: 1, since O (128 registers at MT = 2) plus S would spill; MT = 2 with 32-key
// blocks and Q re-read from shared memory was measured slower too (docs/PERFORMANCE.md, v3).
template <int D>
struct FwdCfg;
template <>
struct FwdCfg<64> {
  static constexpr int MT = 2;
};
template <>
struct FwdCfg<128> {
  static constexpr int MT = 1;
};

template <typename T, int D, int MT>
constexpr int fwd_smem_bytes() {
  return (16 * kWarps * MT + 4 * kBc) * D * static_cast<int>(sizeof(T));  // Q + 2x K and V
}

template <typename T, int D, int MT>
__global__ void __launch_bounds__(kThreads) flash_fwd_kernel(const FlashAttnParams p) {
  constexpr int kBr = 16 * kWarps * MT;
  static_assert(MT * D <= 128, "Q fragments and O must fit in registers");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBr * D;  // [2][kBc * D]
  T* sV = sK + 2 * kBc * D;  // [2][kBc * D]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest causal blocks first
  const int b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const SeqInfo s = seq_info(p, b);
  if (m_block * kBr >= s.seqlen_q) return;

  const T* q = static_cast<const T*>(p.q) + row_base(p.q_strides, b, s.q_start + m_block * kBr, h);
  const T* k = static_cast<const T*>(p.k) + row_base(p.k_strides, b, s.k_start, h);
  const T* v = static_cast<const T*>(p.v) + row_base(p.v_strides, b, s.k_start, h);
  T* o = static_cast<T*>(p.o) + row_base(p.o_strides, b, s.q_start + m_block * kBr, h);
  float* lse = p.lse + static_cast<int64_t>(b) * p.lse_batch_stride +
               static_cast<int64_t>(h) * p.lse_head_stride + s.q_start + m_block * kBr;
  const int q_valid = s.seqlen_q - m_block * kBr;
  const int row_local0 = warp * 16 * MT;  // this warp's first row within the block

  const int n_end = key_block_end(m_block, kBr, kBc, s, p.causal);
  float acc_o[MT][D / 8][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < D / 8; ++j) acc_o[i][j][0] = acc_o[i][j][1] = acc_o[i][j][2] = acc_o[i][j][3] = 0.f;

  if (n_end == 0) {  // no key visible to any row of the block: O = 0, LSE = +inf
    const float zero[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const int r = row_local0 + 16 * i + g;
      store_rows<T, D>(o, p.o_strides.row, row_local0 + 16 * i, q_valid, acc_o[i], zero, lane);
      if (t == 0) {
        if (r < q_valid) lse[r] = INFINITY;
        if (r + 8 < q_valid) lse[r + 8] = INFINITY;
      }
    }
    return;
  }

  load_tile<T, kBr, D, kThreads>(sQ, q, p.q_strides.row, q_valid, tid);
  {
    const int n = n_end - 1;
    load_tile<T, kBc, D, kThreads>(sK, k + n * kBc * p.k_strides.row, p.k_strides.row,
                                   s.seqlen_k - n * kBc, tid);
    load_tile<T, kBc, D, kThreads>(sV, v + n * kBc * p.v_strides.row, p.v_strides.row,
                                   s.seqlen_k - n * kBc, tid);
  }
  cp_async_commit();

  const float c2 = p.softmax_scale * kLog2e;
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) row_max[i][0] = row_max[i][1] = -INFINITY, row_sum[i][0] = row_sum[i][1] = 0.f;
  uint32_t qf[MT][D / 16][4];
  // Query rows of this thread, in the sequence (m-tile i: r0 + 16 i, + 8).
  const int r0 = m_block * kBr + row_local0 + g;
  const int diag = s.seqlen_k - s.seqlen_q;

  for (int n = n_end - 1, it = 0; n >= 0; --n, ++it) {
    cp_async_wait_all();
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ld_a<D>(qf[i][kk], sQ, row_local0 + 16 * i, kk * 16, lane);
    }
    if (n > 0) {  // prefetch the next (lower) key block into the other buffer
      const int buf = (it + 1) & 1, nn = n - 1;
      load_tile<T, kBc, D, kThreads>(sK + buf * kBc * D, k + nn * kBc * p.k_strides.row,
                                     p.k_strides.row, s.seqlen_k - nn * kBc, tid);
      load_tile<T, kBc, D, kThreads>(sV + buf * kBc * D, v + nn * kBc * p.v_strides.row,
                                     p.v_strides.row, s.seqlen_k - nn * kBc, tid);
    }
    cp_async_commit();
    const T* cK = sK + (it & 1) * kBc * D;
    const T* cV = sV + (it & 1) * kBc * D;

    float acc_s[MT][kBc / 8][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) acc_s[i][j][0] = acc_s[i][j][1] = acc_s[i][j][2] = acc_s[i][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < kBc / 16; ++nn) {
        uint32_t bf[4];
        ld_b_nk<D>(bf, cK, nn * 16, kk * 16, lane);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mma16816<T>(acc_s[i][2 * nn], qf[i][kk], bf[0], bf[1]);
          mma16816<T>(acc_s[i][2 * nn + 1], qf[i][kk], bf[2], bf[3]);
        }
      }
    }

    const bool need_mask = (n + 1) * kBc > s.seqlen_k ||
                           (p.causal && (n + 1) * kBc - 1 > m_block * kBr + row_local0 + diag);
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n * kBc + j * 8 + 2 * t + (e & 1);
            const int row = r0 + 16 * i + (e >> 1) * 8;
            if (col >= s.seqlen_k || (p.causal && col > row + diag)) acc_s[i][j][e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax over the rows this thread holds (g and g + 8 per m-tile), shared by the 4
    // lanes t.
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = row_max[i][half];
#pragma unroll
        for (int j = 0; j < kBc / 8; ++j)
          mx = fmaxf(mx, fmaxf(acc_s[i][j][2 * half], acc_s[i][j][2 * half + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row with nothing visible yet keeps max -inf: subtract 0 so exp2 gives 0, never NaN.
        const float base = mx == -INFINITY ? 0.f : mx * c2;
        const float alpha = exp2f(row_max[i][half] * c2 - base);
        row_max[i][half] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kBc / 8; ++j) {
          acc_s[i][j][2 * half] = exp2f(acc_s[i][j][2 * half] * c2 - base);
          acc_s[i][j][2 * half + 1] = exp2f(acc_s[i][j][2 * half + 1] * c2 - base);
          sum += acc_s[i][j][2 * half] + acc_s[i][j][2 * half + 1];
        }
        row_sum[i][half] = row_sum[i][half] * alpha + sum;  // lane-partial; reduced after the loop
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          acc_o[i][j][2 * half] *= alpha;
          acc_o[i][j][2 * half + 1] *= alpha;
        }
      }
    }

#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t af[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        af[i][0] = pack2<T>(acc_s[i][2 * kk][0], acc_s[i][2 * kk][1]);
        af[i][1] = pack2<T>(acc_s[i][2 * kk][2], acc_s[i][2 * kk][3]);
        af[i][2] = pack2<T>(acc_s[i][2 * kk + 1][0], acc_s[i][2 * kk + 1][1]);
        af[i][3] = pack2<T>(acc_s[i][2 * kk + 1][2], acc_s[i][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bf[4];
        ld_b_kn<D>(bf, cV, kk * 16, dn * 16, lane);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mma16816<T>(acc_o[i][2 * dn], af[i], bf[0], bf[1]);
          mma16816<T>(acc_o[i][2 * dn + 1], af[i], bf[2], bf[3]);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < MT; ++i) {
    float inv[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = row_sum[i][half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv[half] = l > 0.f ? 1.f / l : 0.f;
      const float value = l > 0.f ? row_max[i][half] * p.softmax_scale + logf(l) : INFINITY;
      const int r = row_local0 + 16 * i + g + half * 8;
      if (t == 0 && r < q_valid) lse[r] = value;
    }
    store_rows<T, D>(o, p.o_strides.row, row_local0 + 16 * i, q_valid, acc_o[i], inv, lane);
  }
}

template <typename T, int D>
cudaError_t launch_fwd(const FlashAttnParams& p, cudaStream_t stream) {
  constexpr int MT = FwdCfg<D>::MT;
  constexpr int smem = fwd_smem_bytes<T, D, MT>(), kBr = 16 * kWarps * MT;
  static const cudaError_t attr = set_smem(flash_fwd_kernel<T, D, MT>, smem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid((p.seqlen_q + kBr - 1) / kBr, p.batch * p.heads);
  if (grid.x == 0 || grid.y == 0) return cudaSuccess;
  flash_fwd_kernel<T, D, MT><<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace
}  // namespace flash

bool flash_attention_supported(int head_dim, DType dtype) {
  return (head_dim == 64 || head_dim == 128) &&
         (dtype == DType::kBFloat16 || dtype == DType::kFloat16);
}

cudaError_t flash_attention_fwd(const FlashAttnParams& p, cudaStream_t stream) {
  if (!flash_attention_supported(p.head_dim, p.dtype)) return cudaErrorInvalidValue;
  if (flash_attention_uses_wgmma()) return flash_attention_fwd_sm90(p, stream);
  return flash::dispatch(p.dtype, p.head_dim, [&](auto t, auto d) {
    return flash::launch_fwd<typename decltype(t)::type, decltype(d)::value>(p, stream);
  });
}

}  // namespace strobe::ops::cuda
