// Flash-attention backward v4 for Hopper (sm_90a): v1's deterministic two-kernel scheme
// (flash_bwd.cu: dK/dV per key block, dQ per query block, no atomics, 7 matmuls) with every
// matmul on warpgroup MMAs (wgmma.mma_async) instead of mma.sync. One CTA = one warpgroup of 4
// warps; each warp keeps v1's 16 rows, so the masking and softmax code is v1's unchanged.
//   dK/dV (64 keys per CTA): S^T = K Q^T and dP^T = V dO^T read both operands from shared memory
//     (m64n64k16, K and Q / V and dO K-major); P^T and dS^T stay in registers as the A operand of
//     dV += P^T dO and dK += dS^T Q (m64nDk16, dO and Q read N-major from the same tiles). At
//     head_dim 64 (kOverlap) P^T is computed while dP^T is still in the tensor cores and dS^T while
//     dV's MMAs run (wgmma groups waited one at a time).
//   dQ (64 query rows per CTA): S = Q K^T, dP = dO V^T from shared memory, dQ += dS K with dS
//     from registers and K read N-major.
// A wgmma reads 64 rows' worth of B per shared-memory access where mma.sync's warp reads 16, which
// is what bounded v1 (docs/PERFORMANCE.md). Tiles use flash_sm90.cuh's panel layout; cp.async
// fills them (double-buffered), fence.proxy.async publishes them to the tensor cores.
// Built for sm_90a only (its own object library); flash_bwd.cu launches it on devices of compute
// capability 9.0 and v1 everywhere else.
#include <cfloat>
#include <cmath>

#include "strobe/ops/cuda/flash_common.cuh"
#include "strobe/ops/cuda/flash_sm90.cuh"

namespace strobe::ops::cuda {
namespace flash {
namespace {

using namespace sm90;  // NOLINT(google-build-using-namespace): this file's building blocks

constexpr int kThreads = sm90::kWarpgroupThreads, kBr = 64, kBc = 64;

template <typename T, int D>
constexpr int dkdv_smem_bytes() {
  return (2 * kBc + 4 * kBr) * D * static_cast<int>(sizeof(T)) +
         4 * kBr * static_cast<int>(sizeof(float)) + 1024;
}

template <typename T, int D, bool kOverlap>
__global__ void __launch_bounds__(kThreads) flash_bwd_dkdv_sm90(const FlashAttnParams p) {
#ifdef STROBE_SM90A_DEVICE
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(align_1024(smem_raw));
  T* sV = sK + kBc * D;
  T* sQ = sV + kBc * D;  // [2][kBr * D]
  T* sdO = sQ + 2 * kBr * D;  // [2][kBr * D]
  float* sL = reinterpret_cast<float*>(sdO + 2 * kBr * D);  // [2][kBr]
  float* sDs = sL + 2 * kBr;  // [2][kBr]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_block = blockIdx.x;
  const int b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const SeqInfo s = seq_info(p, b);
  if (n_block * kBc >= s.seqlen_k) return;

  const T* q = static_cast<const T*>(p.q) + row_base(p.q_strides, b, s.q_start, h);
  const T* dout = static_cast<const T*>(p.dout) + row_base(p.o_strides, b, s.q_start, h);
  const T* k = static_cast<const T*>(p.k) + row_base(p.k_strides, b, s.k_start + n_block * kBc, h);
  const T* v = static_cast<const T*>(p.v) + row_base(p.v_strides, b, s.k_start + n_block * kBc, h);
  const int64_t stat_base = static_cast<int64_t>(b) * p.lse_batch_stride +
                            static_cast<int64_t>(h) * p.lse_head_stride + s.q_start;
  const float* lse = p.lse + stat_base;
  const float* dsum = p.dsum + stat_base;
  const int k_valid = s.seqlen_k - n_block * kBc;
  const int diag = s.seqlen_k - s.seqlen_q;

  int m_begin = 0;
  if (p.causal) m_begin = max(0, n_block * kBc - diag) / kBr;
  const int m_end = ceil_div(s.seqlen_q, kBr);

  auto load_q_block = [&](int m, int buf) {
    const int valid = s.seqlen_q - m * kBr;
    load_panels<T, kBr, D>(sQ + buf * kBr * D, q + m * kBr * p.q_strides.row, p.q_strides.row,
                           valid, tid);
    load_panels<T, kBr, D>(sdO + buf * kBr * D, dout + m * kBr * p.o_strides.row,
                           p.o_strides.row, valid, tid);
    if (tid < kBr) {
      const int r = m * kBr + tid;
      sL[buf * kBr + tid] = r < s.seqlen_q ? lse[r] * kLog2e : INFINITY;
      sDs[buf * kBr + tid] = r < s.seqlen_q ? dsum[r] : 0.f;
    }
  };

  load_panels<T, kBc, D>(sK, k, p.k_strides.row, k_valid, tid);
  load_panels<T, kBc, D>(sV, v, p.v_strides.row, k_valid, tid);
  if (m_begin < m_end) load_q_block(m_begin, 0);
  cp_async_commit();

  float acc_dk[D / 8][4], acc_dv[D / 8][4];
  zero_acc(acc_dk);
  zero_acc(acc_dv);
  const float c2 = p.softmax_scale * kLog2e;
  const int c0 = n_block * kBc + warp * 16 + g;  // this thread's keys: c0 and c0 + 8
  const uint32_t aK = smem_u32(sK), aV = smem_u32(sV);

  for (int m = m_begin, it = 0; m < m_end; ++m, ++it) {
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    if (m + 1 < m_end) load_q_block(m + 1, (it + 1) & 1);
    cp_async_commit();
    const int buf = it & 1;
    const uint32_t aQ = smem_u32(sQ + buf * kBr * D), adO = smem_u32(sdO + buf * kBr * D);
    const float* cL = sL + buf * kBr;
    const float* cDs = sDs + buf * kBr;

    float acc_s[kBr / 8][4], acc_dp[kBr / 8][4];
    zero_fenced(acc_s);
    zero_fenced(acc_dp);
    wgmma_fence();
    mma_ss<T, kBr, D / 16>(acc_s, aK, aQ);
    wgmma_commit();
    mma_ss<T, kBr, D / 16>(acc_dp, aV, adO);
    wgmma_commit();
    const bool need_mask = k_valid < kBc || (m + 1) * kBr > s.seqlen_q ||
                           (p.causal && n_block * kBc + kBc - 1 > m * kBr + diag);
    uint32_t ap[kBr / 16][4], ads[kBr / 16][4];
    // kOverlap: P^T while dP^T is still in the tensor cores, dS^T while dV += P^T dO runs.
    wgmma_wait<kOverlap ? 1 : 0>();
    fence_acc(acc_s);
    // acc_s becomes P^T, acc_dp becomes dS^T (rows: keys; columns: queries).
#pragma unroll
    for (int j = 0; j < kBr / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qcol = j * 8 + 2 * t + (e & 1);
        float pv = exp2f(acc_s[j][e] * c2 - cL[qcol]);
        if (need_mask) {
          const int key = c0 + (e >> 1) * 8, row = m * kBr + qcol;
          if (key >= s.seqlen_k || row >= s.seqlen_q || (p.causal && key > row + diag)) pv = 0.f;
        }
        acc_s[j][e] = pv;
      }
    }
    to_a<T>(ap, acc_s);
    if (kOverlap) {
      fence_frag(ap);
      wgmma_fence();
      mma_rs<T, D>(acc_dv, ap, adO);
      wgmma_commit();
      wgmma_wait<1>();
    }
    fence_acc(acc_dp);
#pragma unroll
    for (int j = 0; j < kBr / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dp[j][e] = acc_s[j][e] * (acc_dp[j][e] - cDs[j * 8 + 2 * t + (e & 1)]);
    }
    to_a<T>(ads, acc_dp);
    if (!kOverlap) fence_frag(ap);
    fence_frag(ads);
    wgmma_fence();
    if (!kOverlap) {
      mma_rs<T, D>(acc_dv, ap, adO);
    }
    mma_rs<T, D>(acc_dk, ads, aQ);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(acc_dv);
    fence_acc(acc_dk);
  }

  cp_async_wait_all();  // no query block: the K/V copies must still land before the CTA exits
  T* dk = static_cast<T*>(p.dk) + row_base(p.dk_strides, b, s.k_start + n_block * kBc, h);
  T* dv = static_cast<T*>(p.dv) + row_base(p.dv_strides, b, s.k_start + n_block * kBc, h);
  const float sc[2] = {p.softmax_scale, p.softmax_scale}, one[2] = {1.f, 1.f};
  store_rows<T, D>(dk, p.dk_strides.row, warp * 16, k_valid, acc_dk, sc, lane);
  store_rows<T, D>(dv, p.dv_strides.row, warp * 16, k_valid, acc_dv, one, lane);
#endif
}

template <typename T, int D>
constexpr int dq_smem_bytes() {
  return (2 * kBr + 4 * kBc) * D * static_cast<int>(sizeof(T)) + 1024;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) flash_bwd_dq_sm90(const FlashAttnParams p) {
#ifdef STROBE_SM90A_DEVICE
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(align_1024(smem_raw));
  T* sdO = sQ + kBr * D;
  T* sK = sdO + kBr * D;  // [2][kBc * D]
  T* sV = sK + 2 * kBc * D;  // [2][kBc * D]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const SeqInfo s = seq_info(p, b);
  if (m_block * kBr >= s.seqlen_q) return;

  const T* q = static_cast<const T*>(p.q) + row_base(p.q_strides, b, s.q_start + m_block * kBr, h);
  const T* dout = static_cast<const T*>(p.dout) + row_base(p.o_strides, b, s.q_start + m_block * kBr, h);
  const T* k = static_cast<const T*>(p.k) + row_base(p.k_strides, b, s.k_start, h);
  const T* v = static_cast<const T*>(p.v) + row_base(p.v_strides, b, s.k_start, h);
  T* dq = static_cast<T*>(p.dq) + row_base(p.dq_strides, b, s.q_start + m_block * kBr, h);
  const int q_valid = s.seqlen_q - m_block * kBr;
  const int diag = s.seqlen_k - s.seqlen_q;

  float acc_dq[D / 8][4];
  zero_acc(acc_dq);
  const int n_end = key_block_end(m_block, kBr, kBc, s, p.causal);
  const float sc[2] = {p.softmax_scale, p.softmax_scale};
  if (n_end == 0) {
    store_rows<T, D>(dq, p.dq_strides.row, warp * 16, q_valid, acc_dq, sc, lane);
    return;
  }

  load_panels<T, kBr, D>(sQ, q, p.q_strides.row, q_valid, tid);
  load_panels<T, kBr, D>(sdO, dout, p.o_strides.row, q_valid, tid);
  {
    const int n = n_end - 1;
    load_panels<T, kBc, D>(sK, k + n * kBc * p.k_strides.row, p.k_strides.row,
                           s.seqlen_k - n * kBc, tid);
    load_panels<T, kBc, D>(sV, v + n * kBc * p.v_strides.row, p.v_strides.row,
                           s.seqlen_k - n * kBc, tid);
  }
  cp_async_commit();

  const int64_t stat_base = static_cast<int64_t>(b) * p.lse_batch_stride +
                            static_cast<int64_t>(h) * p.lse_head_stride + s.q_start;
  float row_l[2], row_d[2];
  const int r0 = m_block * kBr + warp * 16 + g;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + half * 8;
    row_l[half] = r < s.seqlen_q ? p.lse[stat_base + r] * kLog2e : INFINITY;
    row_d[half] = r < s.seqlen_q ? p.dsum[stat_base + r] : 0.f;
  }
  const float c2 = p.softmax_scale * kLog2e;
  const uint32_t aQ = smem_u32(sQ), adO = smem_u32(sdO);

  for (int n = n_end - 1, it = 0; n >= 0; --n, ++it) {
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    if (n > 0) {
      const int buf = (it + 1) & 1, nn = n - 1;
      load_panels<T, kBc, D>(sK + buf * kBc * D, k + nn * kBc * p.k_strides.row, p.k_strides.row,
                             s.seqlen_k - nn * kBc, tid);
      load_panels<T, kBc, D>(sV + buf * kBc * D, v + nn * kBc * p.v_strides.row, p.v_strides.row,
                             s.seqlen_k - nn * kBc, tid);
    }
    cp_async_commit();
    const uint32_t aK = smem_u32(sK + (it & 1) * kBc * D), aV = smem_u32(sV + (it & 1) * kBc * D);

    float acc_s[kBc / 8][4], acc_dp[kBc / 8][4];
    zero_fenced(acc_s);
    zero_fenced(acc_dp);
    wgmma_fence();
    mma_ss<T, kBc, D / 16>(acc_s, aQ, aK);
    mma_ss<T, kBc, D / 16>(acc_dp, adO, aV);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(acc_s);
    fence_acc(acc_dp);

    const bool need_mask = (n + 1) * kBc > s.seqlen_k ||
                           (p.causal && (n + 1) * kBc - 1 > m_block * kBr + diag);
#pragma unroll
    for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e >> 1;
        float pv = exp2f(acc_s[j][e] * c2 - row_l[half]);
        if (need_mask) {
          const int col = n * kBc + j * 8 + 2 * t + (e & 1), row = r0 + half * 8;
          if (col >= s.seqlen_k || (p.causal && col > row + diag)) pv = 0.f;
        }
        acc_dp[j][e] = pv * (acc_dp[j][e] - row_d[half]);
      }
    }

    uint32_t ads[kBc / 16][4];
    to_a<T>(ads, acc_dp);
    fence_frag(ads);
    wgmma_fence();
    mma_rs<T, D>(acc_dq, ads, aK);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(acc_dq);
  }
  store_rows<T, D>(dq, p.dq_strides.row, warp * 16, q_valid, acc_dq, sc, lane);
#endif
}

template <typename T, int D>
cudaError_t launch(const FlashAttnParams& p, cudaStream_t stream) {
  // head_dim 64 overlaps the dK/dV kernel's softmax with its MMAs (kOverlap); at 128 the extra live
  // registers spill and it was slower (docs/PERFORMANCE.md, v4).
  constexpr bool kOverlap = D == 64;
  constexpr int smem_kv = dkdv_smem_bytes<T, D>(), smem_q = dq_smem_bytes<T, D>();
  static const cudaError_t attr1 = set_smem(flash_bwd_dkdv_sm90<T, D, kOverlap>, smem_kv);
  static const cudaError_t attr2 = set_smem(flash_bwd_dq_sm90<T, D>, smem_q);
  if (attr1 != cudaSuccess) return attr1;
  if (attr2 != cudaSuccess) return attr2;
  if (p.seqlen_k > 0) {
    const dim3 grid((p.seqlen_k + kBc - 1) / kBc, p.batch * p.heads);
    flash_bwd_dkdv_sm90<T, D, kOverlap><<<grid, kThreads, smem_kv, stream>>>(p);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (p.seqlen_q > 0) {
    const dim3 grid((p.seqlen_q + kBr - 1) / kBr, p.batch * p.heads);
    flash_bwd_dq_sm90<T, D><<<grid, kThreads, smem_q, stream>>>(p);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace flash

// dK, dV and dQ of the backward (the Dsum pre-pass already ran): flash_bwd.cu calls it on compute
// capability 9.0 devices.
cudaError_t flash_attention_bwd_sm90(const FlashAttnParams& p, cudaStream_t stream) {
  return flash::dispatch(p.dtype, p.head_dim, [&](auto t, auto d) {
    return flash::launch<typename decltype(t)::type, decltype(d)::value>(p, stream);
  });
}

}  // namespace strobe::ops::cuda
