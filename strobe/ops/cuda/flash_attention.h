// Launchers of the flash-attention kernels (strobe/ops/cuda/flash_*.cu): raw pointers, strides
// and a stream only, no torch header. Every launcher enqueues on `stream` and never syncs.
//
// Layouts. Fixed length: q [B, Sq, H, D], k/v [B, Sk, H, D]. Varlen: q [Tq, H, D], k/v [Tk, H, D]
// with int32 cu_seqlens_q/k [B + 1] on the device (sequence b is rows cu[b] .. cu[b+1]) and
// seqlen_q/k holding the host-side maxima. Only the last dimension must be contiguous; the other
// strides are free (a q view of a fused qkv projection needs no copy) but must keep 16-byte rows.
// Causal masking is bottom-right aligned: query row r sees key c iff c <= r + (Sk - Sq), per
// sequence. A query row that sees no key gets O = 0 and LSE = +inf.
// LSE (natural log, fp32) is [B, H, Sq] for fixed length and [H, Tq] for varlen.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "strobe/ops/cuda/launchers.h"

namespace strobe::ops::cuda {

// Element strides of a [batch, row, head, :] tensor (batch is unused under varlen).
struct AttnStrides {
  int64_t batch = 0, row = 0, head = 0;
};

struct FlashAttnParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  AttnStrides q_strides, k_strides, v_strides;
  void* o = nullptr;  // forward output / backward input, same layout as q
  AttnStrides o_strides;
  float* lse = nullptr;  // forward output / backward input
  int64_t lse_batch_stride = 0, lse_head_stride = 0;  // lse index: b*bs + h*hs + global q row
  const int* cu_seqlens_q = nullptr;  // null: fixed length
  const int* cu_seqlens_k = nullptr;
  int batch = 0, heads = 0;
  int seqlen_q = 0, seqlen_k = 0;  // fixed: the lengths; varlen: the maxima
  int total_q = 0;  // rows of q (B*Sq or Tq), for the backward preprocess
  int head_dim = 0;  // 64 or 128
  float softmax_scale = 0.f;
  bool causal = false;
  DType dtype = DType::kBFloat16;  // kBFloat16 or kFloat16

  // Backward only.
  const void* dout = nullptr;  // same shape as q, contiguous
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  AttnStrides dq_strides, dk_strides, dv_strides;
  float* dsum = nullptr;  // workspace laid out like lse: rowsum(dO * O)
};

// Whether the kernels cover this head_dim / dtype (the glue turns `false` into a clear error).
bool flash_attention_supported(int head_dim, DType dtype);
cudaError_t flash_attention_fwd(const FlashAttnParams& params, cudaStream_t stream);
// Deterministic: dK/dV by key block, dQ by a separate query-block pass (no atomics).
cudaError_t flash_attention_bwd(const FlashAttnParams& params, cudaStream_t stream);
// Whether flash_attention_fwd/bwd run the Hopper kernels on the current device: forward v4 and
// backward v4 on warpgroup MMAs (wgmma, compute capability 9.0, H100/H200), else the mma.sync
// kernels (forward v3, backward v1) that every other GPU runs. STROBE_FLASH_ATTN=mma in the
// environment (read once) forces the mma.sync kernels, for benchmarks and tests of them on Hopper.
bool flash_attention_uses_wgmma();
// The Hopper kernels (flash_fwd_sm90.cu, flash_bwd_sm90.cu; built for sm_90a). The backward one
// launches dK/dV and dQ only: flash_attention_bwd's Dsum pre-pass must have run.
cudaError_t flash_attention_fwd_sm90(const FlashAttnParams& params, cudaStream_t stream);
cudaError_t flash_attention_bwd_sm90(const FlashAttnParams& params, cudaStream_t stream);

}  // namespace strobe::ops::cuda
