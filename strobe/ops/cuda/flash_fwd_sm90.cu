// Flash-attention forward v4 for Hopper (sm_90a): v3's online softmax (flash_fwd.cu) with both
// matmuls on warpgroup MMAs. One CTA = one warpgroup of 4 warps owning 64 query rows of one (batch,
// head) (each warp 16 rows, v3's register layout, so the masking and softmax code is v3's with one
// m-tile); key blocks of 64 stream through double-buffered shared memory (cp.async).
//   S = Q K^T: m64n64k16, Q and K from shared memory (K-major).
//   O += P V:  m64nDk16, P from registers (the S accumulators rescaled and packed), V read N-major.
// Key blocks run from the highest down, as in v3, so only the first ones pay for the mask.
// Built for sm_90a only (its own object library); flash_fwd.cu launches it on compute capability 9.0.
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
constexpr int fwd_smem_bytes() {
  return (kBr + 4 * kBc) * D * static_cast<int>(sizeof(T)) + 1024;  // Q + 2x K and V
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) flash_fwd_sm90(const FlashAttnParams p) {
#ifdef STROBE_SM90A_DEVICE
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(align_1024(smem_raw));
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
  const int row_local0 = warp * 16;

  const int n_end = key_block_end(m_block, kBr, kBc, s, p.causal);
  float acc_o[D / 8][4];
  zero_acc(acc_o);

  if (n_end == 0) {  // no key visible to any row of the block: O = 0, LSE = +inf
    const float zero[2] = {0.f, 0.f};
    const int r = row_local0 + g;
    store_rows<T, D>(o, p.o_strides.row, row_local0, q_valid, acc_o, zero, lane);
    if (t == 0) {
      if (r < q_valid) lse[r] = INFINITY;
      if (r + 8 < q_valid) lse[r + 8] = INFINITY;
    }
    return;
  }

  load_panels<T, kBr, D>(sQ, q, p.q_strides.row, q_valid, tid);
  {
    const int n = n_end - 1;
    load_panels<T, kBc, D>(sK, k + n * kBc * p.k_strides.row, p.k_strides.row,
                           s.seqlen_k - n * kBc, tid);
    load_panels<T, kBc, D>(sV, v + n * kBc * p.v_strides.row, p.v_strides.row,
                           s.seqlen_k - n * kBc, tid);
  }
  cp_async_commit();

  const float c2 = p.softmax_scale * kLog2e;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const int r0 = m_block * kBr + row_local0 + g;  // this thread's rows: r0 and r0 + 8
  const int diag = s.seqlen_k - s.seqlen_q;
  const uint32_t aQ = smem_u32(sQ);

  for (int n = n_end - 1, it = 0; n >= 0; --n, ++it) {
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    if (n > 0) {  // prefetch the next (lower) key block into the other buffer
      const int buf = (it + 1) & 1, nn = n - 1;
      load_panels<T, kBc, D>(sK + buf * kBc * D, k + nn * kBc * p.k_strides.row, p.k_strides.row,
                             s.seqlen_k - nn * kBc, tid);
      load_panels<T, kBc, D>(sV + buf * kBc * D, v + nn * kBc * p.v_strides.row, p.v_strides.row,
                             s.seqlen_k - nn * kBc, tid);
    }
    cp_async_commit();
    const uint32_t aK = smem_u32(sK + (it & 1) * kBc * D), aV = smem_u32(sV + (it & 1) * kBc * D);

    float acc_s[kBc / 8][4];
    zero_fenced(acc_s);
    wgmma_fence();
    mma_ss<T, kBc, D / 16>(acc_s, aQ, aK);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(acc_s);

    const bool need_mask = (n + 1) * kBc > s.seqlen_k ||
                           (p.causal && (n + 1) * kBc - 1 > m_block * kBr + row_local0 + diag);
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n * kBc + j * 8 + 2 * t + (e & 1);
          const int row = r0 + (e >> 1) * 8;
          if (col >= s.seqlen_k || (p.causal && col > row + diag)) acc_s[j][e] = -INFINITY;
        }
      }
    }

    // Online softmax over the rows this thread holds (g and g + 8), shared by the 4 lanes t.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = row_max[half];
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) mx = fmaxf(mx, fmaxf(acc_s[j][2 * half], acc_s[j][2 * half + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // A row with nothing visible yet keeps max -inf: subtract 0 so exp2 gives 0, never NaN.
      const float base = mx == -INFINITY ? 0.f : mx * c2;
      const float alpha = exp2f(row_max[half] * c2 - base);
      row_max[half] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) {
        acc_s[j][2 * half] = exp2f(acc_s[j][2 * half] * c2 - base);
        acc_s[j][2 * half + 1] = exp2f(acc_s[j][2 * half + 1] * c2 - base);
        sum += acc_s[j][2 * half] + acc_s[j][2 * half + 1];
      }
      row_sum[half] = row_sum[half] * alpha + sum;  // lane-partial; reduced after the loop
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        acc_o[j][2 * half] *= alpha;
        acc_o[j][2 * half + 1] *= alpha;
      }
    }

    uint32_t ap[kBc / 16][4];
    to_a<T>(ap, acc_s);
    fence_frag(ap);
    fence_acc(acc_o);
    wgmma_fence();
    mma_rs<T, D>(acc_o, ap, aV);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(acc_o);
  }

  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float l = row_sum[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[half] = l > 0.f ? 1.f / l : 0.f;
    const float value = l > 0.f ? row_max[half] * p.softmax_scale + logf(l) : INFINITY;
    const int r = row_local0 + g + half * 8;
    if (t == 0 && r < q_valid) lse[r] = value;
  }
  store_rows<T, D>(o, p.o_strides.row, row_local0, q_valid, acc_o, inv, lane);
#endif
}

template <typename T, int D>
cudaError_t launch(const FlashAttnParams& p, cudaStream_t stream) {
  constexpr int smem = fwd_smem_bytes<T, D>();
  static const cudaError_t attr = set_smem(flash_fwd_sm90<T, D>, smem);
  if (attr != cudaSuccess) return attr;
  const dim3 grid((p.seqlen_q + kBr - 1) / kBr, p.batch * p.heads);
  if (grid.x == 0 || grid.y == 0) return cudaSuccess;
  flash_fwd_sm90<T, D><<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace
}  // namespace flash

cudaError_t flash_attention_fwd_sm90(const FlashAttnParams& p, cudaStream_t stream) {
  return flash::dispatch(p.dtype, p.head_dim, [&](auto t, auto d) {
    return flash::launch<typename decltype(t)::type, decltype(d)::value>(p, stream);
  });
}

}  // namespace strobe::ops::cuda
