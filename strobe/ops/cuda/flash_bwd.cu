// Flash-attention backward on mma.sync (kernel version v1; see docs/PERFORMANCE.md), deterministic
// by construction: no floating-point atomics anywhere. On compute capability 9.0 (H100/H200) the
// Dsum pre-pass below is followed by v4's wgmma kernels (flash_bwd_sm90.cu) instead of v1's
// (flash_attention_uses_wgmma, defined here, decides for the forward too).
//   1. preprocess: Dsum = rowsum(float(dO) * float(O)) per (row, head), laid out like LSE.
//   2. dK/dV: one CTA of 4 warps per 64-key block; each warp owns 16 keys and loops over the query
//      blocks that see them, computing S^T = K Q^T and dP^T = V dO^T, so P^T and dS^T land in
//      registers already shaped as the A operand of dV += P^T dO and dK += dS^T Q.
//   3. dQ: one CTA per 64-row query block, looping over key blocks like the forward:
//      S = Q K^T, dP = dO V^T, dS = P (dP - Dsum), dQ += dS K. Recomputing S and dP costs two more
//      matmuls than the atomic-add scheme (7 against 5) but keeps dQ exact and reproducible.
// P = exp2(S * scale * log2e - LSE * log2e) is rebuilt exactly from the forward's LSE; rows with
// LSE = +inf (no visible key, or past the sequence end) give P = 0.
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "strobe/ops/cuda/flash_common.cuh"

namespace strobe::ops::cuda {
namespace flash {
namespace {

constexpr int kWarps = 4, kThreads = kWarps * 32, kBr = 64, kBc = 64;

// ---- 1. Dsum = rowsum(dO * O) -------------------------------------------------------------------
// One thread per (row, head); rows are t = b * rows_per_batch + s (fixed) or the packed row (varlen,
// rows_per_batch = total rows, lse batch stride 0).
template <typename T, int D>
__global__ void flash_bwd_dsum_kernel(const FlashAttnParams p, int rows_per_batch) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(p.total_q) * p.heads) return;
  const int row = static_cast<int>(i / p.heads), h = static_cast<int>(i % p.heads);
  const int b = row / rows_per_batch, s = row % rows_per_batch;
  const T* o = static_cast<const T*>(p.o) + static_cast<int64_t>(b) * p.o_strides.batch +
               static_cast<int64_t>(s) * p.o_strides.row + static_cast<int64_t>(h) * p.o_strides.head;
  const T* dout = static_cast<const T*>(p.dout) + i * D;  // contiguous [rows, H, D]
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < D; c += 8) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(dout + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += static_cast<float>(oe[e]) * static_cast<float>(de[e]);
  }
  p.dsum[static_cast<int64_t>(b) * p.lse_batch_stride + static_cast<int64_t>(h) * p.lse_head_stride +
         s] = acc;
}

// ---- 2. dK, dV per key block ----------------------------------------------------------------------
template <typename T, int D>
constexpr int dkdv_smem_bytes() {
  // K, V, double-buffered Q and dO, double-buffered LSE*log2e and Dsum.
  return (2 * kBc + 4 * kBr) * D * static_cast<int>(sizeof(T)) + 4 * kBr * static_cast<int>(sizeof(float));
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) flash_bwd_dkdv_kernel(const FlashAttnParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
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

  // Query blocks that see this key block: with causal masking, rows r >= key - diag only.
  int m_begin = 0;
  if (p.causal) m_begin = max(0, n_block * kBc - diag) / kBr;
  const int m_end = ceil_div(s.seqlen_q, kBr);

  auto load_q_block = [&](int m, int buf) {
    const int valid = s.seqlen_q - m * kBr;
    load_tile<T, kBr, D, kThreads>(sQ + buf * kBr * D, q + m * kBr * p.q_strides.row,
                                   p.q_strides.row, valid, tid);
    load_tile<T, kBr, D, kThreads>(sdO + buf * kBr * D, dout + m * kBr * p.o_strides.row,
                                   p.o_strides.row, valid, tid);
    if (tid < kBr) {
      const int r = m * kBr + tid;
      sL[buf * kBr + tid] = r < s.seqlen_q ? lse[r] * kLog2e : INFINITY;
      sDs[buf * kBr + tid] = r < s.seqlen_q ? dsum[r] : 0.f;
    }
  };

  load_tile<T, kBc, D, kThreads>(sK, k, p.k_strides.row, k_valid, tid);
  load_tile<T, kBc, D, kThreads>(sV, v, p.v_strides.row, k_valid, tid);
  if (m_begin < m_end) load_q_block(m_begin, 0);
  cp_async_commit();

  float acc_dk[D / 8][4], acc_dv[D / 8][4];
  zero_acc(acc_dk);
  zero_acc(acc_dv);
  const float c2 = p.softmax_scale * kLog2e;
  const int key_local0 = warp * 16;
  const int c0 = n_block * kBc + key_local0 + g;  // this thread's keys: c0 and c0 + 8

  for (int m = m_begin, it = 0; m < m_end; ++m, ++it) {
    cp_async_wait_all();
    __syncthreads();
    if (m + 1 < m_end) load_q_block(m + 1, (it + 1) & 1);
    cp_async_commit();
    const int buf = it & 1;
    const T* cQ = sQ + buf * kBr * D;
    const T* cdO = sdO + buf * kBr * D;
    const float* cL = sL + buf * kBr;
    const float* cDs = sDs + buf * kBr;

    float acc_s[kBr / 8][4], acc_dp[kBr / 8][4];
    zero_acc(acc_s);
    zero_acc(acc_dp);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ak[4], av[4];
      ld_a<D>(ak, sK, key_local0, kk * 16, lane);
      ld_a<D>(av, sV, key_local0, kk * 16, lane);
#pragma unroll
      for (int nn = 0; nn < kBr / 16; ++nn) {
        uint32_t bq[4], bo[4];
        ld_b_nk<D>(bq, cQ, nn * 16, kk * 16, lane);
        mma16816<T>(acc_s[2 * nn], ak, bq[0], bq[1]);
        mma16816<T>(acc_s[2 * nn + 1], ak, bq[2], bq[3]);
        ld_b_nk<D>(bo, cdO, nn * 16, kk * 16, lane);
        mma16816<T>(acc_dp[2 * nn], av, bo[0], bo[1]);
        mma16816<T>(acc_dp[2 * nn + 1], av, bo[2], bo[3]);
      }
    }

    const bool need_mask = k_valid < kBc || (m + 1) * kBr > s.seqlen_q ||
                           (p.causal && n_block * kBc + kBc - 1 > m * kBr + diag);
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
        acc_dp[j][e] = pv * (acc_dp[j][e] - cDs[qcol]);
      }
    }

#pragma unroll
    for (int kk = 0; kk < kBr / 16; ++kk) {
      uint32_t ap[4], ads[4];
      ap[0] = pack2<T>(acc_s[2 * kk][0], acc_s[2 * kk][1]);
      ap[1] = pack2<T>(acc_s[2 * kk][2], acc_s[2 * kk][3]);
      ap[2] = pack2<T>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
      ap[3] = pack2<T>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
      ads[0] = pack2<T>(acc_dp[2 * kk][0], acc_dp[2 * kk][1]);
      ads[1] = pack2<T>(acc_dp[2 * kk][2], acc_dp[2 * kk][3]);
      ads[2] = pack2<T>(acc_dp[2 * kk + 1][0], acc_dp[2 * kk + 1][1]);
      ads[3] = pack2<T>(acc_dp[2 * kk + 1][2], acc_dp[2 * kk + 1][3]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bo[4], bq[4];
        ld_b_kn<D>(bo, cdO, kk * 16, dn * 16, lane);
        mma16816<T>(acc_dv[2 * dn], ap, bo[0], bo[1]);
        mma16816<T>(acc_dv[2 * dn + 1], ap, bo[2], bo[3]);
        ld_b_kn<D>(bq, cQ, kk * 16, dn * 16, lane);
        mma16816<T>(acc_dk[2 * dn], ads, bq[0], bq[1]);
        mma16816<T>(acc_dk[2 * dn + 1], ads, bq[2], bq[3]);
      }
    }
  }

  cp_async_wait_all();  // no query block: the K/V copies must still land before the CTA exits
  // Keys no query sees still get their (zero) gradients written.
  T* dk = static_cast<T*>(p.dk) + row_base(p.dk_strides, b, s.k_start + n_block * kBc, h);
  T* dv = static_cast<T*>(p.dv) + row_base(p.dv_strides, b, s.k_start + n_block * kBc, h);
  const float sc[2] = {p.softmax_scale, p.softmax_scale}, one[2] = {1.f, 1.f};
  store_rows<T, D>(dk, p.dk_strides.row, key_local0, k_valid, acc_dk, sc, lane);
  store_rows<T, D>(dv, p.dv_strides.row, key_local0, k_valid, acc_dv, one, lane);
}

// ---- 3. dQ per query block ------------------------------------------------------------------------
template <typename T, int D>
constexpr int dq_smem_bytes() {
  return (2 * kBr + 4 * kBc) * D * static_cast<int>(sizeof(T));  // Q, dO, double-buffered K and V
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) flash_bwd_dq_kernel(const FlashAttnParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
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
  const int row_local0 = warp * 16;
  const int diag = s.seqlen_k - s.seqlen_q;

  float acc_dq[D / 8][4];
  zero_acc(acc_dq);
  const int n_end = key_block_end(m_block, kBr, kBc, s, p.causal);
  const float sc[2] = {p.softmax_scale, p.softmax_scale};
  if (n_end == 0) {
    store_rows<T, D>(dq, p.dq_strides.row, row_local0, q_valid, acc_dq, sc, lane);
    return;
  }

  load_tile<T, kBr, D, kThreads>(sQ, q, p.q_strides.row, q_valid, tid);
  load_tile<T, kBr, D, kThreads>(sdO, dout, p.o_strides.row, q_valid, tid);
  {
    const int n = n_end - 1;
    load_tile<T, kBc, D, kThreads>(sK, k + n * kBc * p.k_strides.row, p.k_strides.row,
                                   s.seqlen_k - n * kBc, tid);
    load_tile<T, kBc, D, kThreads>(sV, v + n * kBc * p.v_strides.row, p.v_strides.row,
                                   s.seqlen_k - n * kBc, tid);
  }
  cp_async_commit();

  // Per-row statistics of this thread's rows (g and g + 8).
  const int64_t stat_base = static_cast<int64_t>(b) * p.lse_batch_stride +
                            static_cast<int64_t>(h) * p.lse_head_stride + s.q_start;
  float row_l[2], row_d[2];
  const int r0 = m_block * kBr + row_local0 + g;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + half * 8;
    row_l[half] = r < s.seqlen_q ? p.lse[stat_base + r] * kLog2e : INFINITY;
    row_d[half] = r < s.seqlen_q ? p.dsum[stat_base + r] : 0.f;
  }
  const float c2 = p.softmax_scale * kLog2e;

  for (int n = n_end - 1, it = 0; n >= 0; --n, ++it) {
    cp_async_wait_all();
    __syncthreads();
    if (n > 0) {
      const int buf = (it + 1) & 1, nn = n - 1;
      load_tile<T, kBc, D, kThreads>(sK + buf * kBc * D, k + nn * kBc * p.k_strides.row,
                                     p.k_strides.row, s.seqlen_k - nn * kBc, tid);
      load_tile<T, kBc, D, kThreads>(sV + buf * kBc * D, v + nn * kBc * p.v_strides.row,
                                     p.v_strides.row, s.seqlen_k - nn * kBc, tid);
    }
    cp_async_commit();
    const T* cK = sK + (it & 1) * kBc * D;
    const T* cV = sV + (it & 1) * kBc * D;

    float acc_s[kBc / 8][4], acc_dp[kBc / 8][4];
    zero_acc(acc_s);
    zero_acc(acc_dp);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[4], ao[4];
      ld_a<D>(aq, sQ, row_local0, kk * 16, lane);
      ld_a<D>(ao, sdO, row_local0, kk * 16, lane);
#pragma unroll
      for (int nn = 0; nn < kBc / 16; ++nn) {
        uint32_t bk[4], bv[4];
        ld_b_nk<D>(bk, cK, nn * 16, kk * 16, lane);
        mma16816<T>(acc_s[2 * nn], aq, bk[0], bk[1]);
        mma16816<T>(acc_s[2 * nn + 1], aq, bk[2], bk[3]);
        ld_b_nk<D>(bv, cV, nn * 16, kk * 16, lane);
        mma16816<T>(acc_dp[2 * nn], ao, bv[0], bv[1]);
        mma16816<T>(acc_dp[2 * nn + 1], ao, bv[2], bv[3]);
      }
    }

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

#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t ads[4];
      ads[0] = pack2<T>(acc_dp[2 * kk][0], acc_dp[2 * kk][1]);
      ads[1] = pack2<T>(acc_dp[2 * kk][2], acc_dp[2 * kk][3]);
      ads[2] = pack2<T>(acc_dp[2 * kk + 1][0], acc_dp[2 * kk + 1][1]);
      ads[3] = pack2<T>(acc_dp[2 * kk + 1][2], acc_dp[2 * kk + 1][3]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bk[4];
        ld_b_kn<D>(bk, cK, kk * 16, dn * 16, lane);
        mma16816<T>(acc_dq[2 * dn], ads, bk[0], bk[1]);
        mma16816<T>(acc_dq[2 * dn + 1], ads, bk[2], bk[3]);
      }
    }
  }
  store_rows<T, D>(dq, p.dq_strides.row, row_local0, q_valid, acc_dq, sc, lane);
}

template <typename T, int D>
cudaError_t launch_bwd(const FlashAttnParams& p, bool wgmma, cudaStream_t stream) {
  constexpr int smem_kv = dkdv_smem_bytes<T, D>(), smem_q = dq_smem_bytes<T, D>();
  static const cudaError_t attr1 = set_smem(flash_bwd_dkdv_kernel<T, D>, smem_kv);
  static const cudaError_t attr2 = set_smem(flash_bwd_dq_kernel<T, D>, smem_q);
  if (attr1 != cudaSuccess) return attr1;
  if (attr2 != cudaSuccess) return attr2;
  if (p.batch == 0 || p.heads == 0) return cudaSuccess;
  const int64_t n_rows = static_cast<int64_t>(p.total_q) * p.heads;
  if (n_rows > 0) {
    const int rows_per_batch = p.cu_seqlens_q != nullptr ? p.total_q : p.seqlen_q;
    flash_bwd_dsum_kernel<T, D><<<static_cast<unsigned>((n_rows + 255) / 256), 256, 0, stream>>>(
        p, rows_per_batch);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (wgmma) return flash_attention_bwd_sm90(p, stream);
  if (p.seqlen_k > 0) {
    const dim3 grid((p.seqlen_k + kBc - 1) / kBc, p.batch * p.heads);
    flash_bwd_dkdv_kernel<T, D><<<grid, kThreads, smem_kv, stream>>>(p);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (p.seqlen_q > 0) {
    const dim3 grid((p.seqlen_q + kBr - 1) / kBr, p.batch * p.heads);
    flash_bwd_dq_kernel<T, D><<<grid, kThreads, smem_q, stream>>>(p);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace flash

bool flash_attention_uses_wgmma() {
  static const bool forced_off = [] {
    const char* env = std::getenv("STROBE_FLASH_ATTN");
    return env != nullptr && std::strcmp(env, "mma") == 0;
  }();
  if (forced_off) return false;
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};  // 0: not asked yet, 1: no, 2: yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return false;
  int* slot = device < kMaxDevices ? &cached[device] : nullptr;
  if (slot != nullptr && *slot != 0) return *slot == 2;
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  const bool hopper = major == 9 && minor == 0;
  if (slot != nullptr) *slot = hopper ? 2 : 1;
  return hopper;
}

cudaError_t flash_attention_bwd(const FlashAttnParams& p, cudaStream_t stream) {
  if (!flash_attention_supported(p.head_dim, p.dtype)) return cudaErrorInvalidValue;
  const bool wgmma = flash_attention_uses_wgmma();
  return flash::dispatch(p.dtype, p.head_dim, [&](auto t, auto d) {
    return flash::launch_bwd<typename decltype(t)::type, decltype(d)::value>(p, wgmma, stream);
  });
}

}  // namespace strobe::ops::cuda
