// CUDA kernels of flash_attention_fwd / flash_attention_bwd (launchers in cuda/flash_*.cu).
// Only what the kernels cannot do is an error here (fp32/fp64, head_dim other than 64/128); views
// whose last dimension is contiguous and rows 16-byte aligned go to the kernels without a copy.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "strobe/ops/cuda/flash_attention.h"
#include "strobe/ops/cuda_glue.h"
#include "strobe/ops/flash_attention_internal.h"

namespace strobe::ops {
namespace {

using at::Tensor;

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

// The kernels read 16-byte chunks of rows: last dim contiguous, other strides and the base address
// multiples of 8 elements. Anything else is copied once (a layout fix, not a different algorithm).
Tensor kernel_view(const Tensor& t) {
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && t.stride(d) % 8 == 0;
  return ok ? t : t.contiguous();
}

cuda::AttnStrides strides_of(const Tensor& t, bool varlen) {
  cuda::AttnStrides s;
  if (varlen) {
    s.row = t.stride(0);
    s.head = t.stride(1);
  } else {
    s.batch = t.stride(0);
    s.row = t.stride(1);
    s.head = t.stride(2);
  }
  return s;
}

cuda::FlashAttnParams make_params(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const std::optional<Tensor>& cu_q,
                                  const std::optional<Tensor>& cu_k, const detail::FlashShape& s,
                                  bool causal, double scale) {
  constexpr const char* op = "flash_attention (CUDA)";
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, op,
              ": q, k, v must be bfloat16 or float16, got ", q.scalar_type(),
              " (the tensor-core kernels have no fp32 path; use attention: sdpa or cast)");
  cuda::DType dt = detail::kernel_dtype(q, op, "q", {cuda::DType::kBFloat16, cuda::DType::kFloat16});
  TORCH_CHECK(cuda::flash_attention_supported(static_cast<int>(s.head_dim), dt), op,
              ": head_dim must be 64 or 128, got ", s.head_dim);
  TORCH_CHECK(q.numel() < kMaxInt * 8LL && k.numel() < kMaxInt * 8LL, op,
              ": tensors too large");
  // batch * heads is the grid's y dimension.
  TORCH_CHECK(s.batch * s.heads <= 65535, op, ": batch * heads must be <= 65535, got ",
              s.batch * s.heads);
  TORCH_CHECK(s.seqlen_q < kMaxInt && s.seqlen_k < kMaxInt, op, ": sequences too long");
  cuda::FlashAttnParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_strides = strides_of(q, s.varlen);
  p.k_strides = strides_of(k, s.varlen);
  p.v_strides = strides_of(v, s.varlen);
  if (s.varlen) {
    p.cu_seqlens_q = cu_q->data_ptr<int>();
    p.cu_seqlens_k = cu_k->data_ptr<int>();
  }
  p.batch = static_cast<int>(s.batch);
  p.heads = static_cast<int>(s.heads);
  p.seqlen_q = static_cast<int>(s.seqlen_q);
  p.seqlen_k = static_cast<int>(s.seqlen_k);
  p.total_q = static_cast<int>(s.varlen ? q.size(0) : s.batch * s.seqlen_q);
  p.head_dim = static_cast<int>(s.head_dim);
  p.softmax_scale = static_cast<float>(scale);
  p.causal = causal;
  p.dtype = dt;
  if (s.varlen) {
    p.lse_batch_stride = 0;
    p.lse_head_stride = q.size(0);
  } else {
    p.lse_batch_stride = s.heads * s.seqlen_q;
    p.lse_head_stride = s.seqlen_q;
  }
  return p;
}

std::optional<Tensor> contiguous_opt(const std::optional<Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return t->contiguous();
}

std::tuple<Tensor, Tensor> flash_fwd_cuda(const Tensor& q_in, const Tensor& k_in,
                                          const Tensor& v_in,
                                          const std::optional<Tensor>& cu_seqlens_q,
                                          const std::optional<Tensor>& cu_seqlens_k,
                                          int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                          double softmax_scale) {
  const detail::FlashShape s = detail::flash_check_inputs(
      q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = kernel_view(q_in), k = kernel_view(k_in), v = kernel_view(v_in);
  const auto cq = contiguous_opt(cu_seqlens_q), ck = contiguous_opt(cu_seqlens_k);
  cuda::FlashAttnParams p = make_params(q, k, v, cq, ck, s, causal, softmax_scale);
  const Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const auto lopt = q.options().dtype(at::kFloat);
  const Tensor lse = s.varlen ? at::empty({s.heads, q.size(0)}, lopt)
                              : at::empty({s.batch, s.heads, s.seqlen_q}, lopt);
  if (s.varlen && q.size(0) > 0) {
    // Packed rows past cu_seqlens_q[-1] belong to no sequence: defined values, not garbage.
    out.zero_();
    lse.fill_(std::numeric_limits<float>::infinity());
  }
  p.o = out.data_ptr();
  p.o_strides = strides_of(out, s.varlen);
  p.lse = lse.data_ptr<float>();
  if (q.numel() > 0) C10_CUDA_CHECK(cuda::flash_attention_fwd(p, detail::current_stream()));
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> flash_bwd_cuda(
    const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const Tensor& out, const Tensor& lse, const std::optional<Tensor>& cu_seqlens_q,
    const std::optional<Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool causal, double softmax_scale, bool deterministic) {
  (void)deterministic;  // every path of this backward is deterministic (no atomics)
  const detail::FlashShape s = detail::flash_check_inputs(
      q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale);
  TORCH_CHECK(grad_out.sizes() == q_in.sizes() && out.sizes() == q_in.sizes(),
              "flash_attention backward: grad_out ", grad_out.sizes(), " and out ", out.sizes(),
              " must match q ", q_in.sizes());
  TORCH_CHECK(grad_out.scalar_type() == q_in.scalar_type() && out.scalar_type() == q_in.scalar_type(),
              "flash_attention backward: grad_out and out must have q's dtype ", q_in.scalar_type());
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "flash_attention backward: lse must be float32");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = kernel_view(q_in), k = kernel_view(k_in), v = kernel_view(v_in);
  // dO and O share one stride set in the kernels: both contiguous.
  const Tensor dout = grad_out.contiguous(), o = out.contiguous(), l = lse.contiguous();
  const auto cq = contiguous_opt(cu_seqlens_q), ck = contiguous_opt(cu_seqlens_k);
  cuda::FlashAttnParams p = make_params(q, k, v, cq, ck, s, causal, softmax_scale);
  auto like = [](const Tensor& t) {
    return at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  };
  Tensor dq = like(q), dk = like(k), dv = like(v);
  if (s.varlen) {  // rows past cu_seqlens[-1] get zero gradients
    if (dq.numel() > 0) dq.zero_();
    if (dk.numel() > 0) dk.zero_();
    if (dv.numel() > 0) dv.zero_();
  }
  const Tensor dsum = at::empty(l.sizes(), l.options());
  p.o = o.data_ptr();
  p.o_strides = strides_of(o, s.varlen);
  p.lse = l.data_ptr<float>();
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_strides = strides_of(dq, s.varlen);
  p.dk_strides = strides_of(dk, s.varlen);
  p.dv_strides = strides_of(dv, s.varlen);
  p.dsum = dsum.data_ptr<float>();
  if (q.numel() > 0 || k.numel() > 0) {
    C10_CUDA_CHECK(cuda::flash_attention_bwd(p, detail::current_stream()));
  }
  return {dq, dk, dv};
}

}  // namespace

bool flash_attention_uses_wgmma() { return cuda::flash_attention_uses_wgmma(); }

bool flash_attention_cuda_takes(int64_t head_dim, torch::ScalarType dtype) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  return cuda::flash_attention_supported(static_cast<int>(head_dim),
                                         dtype == at::kBFloat16 ? cuda::DType::kBFloat16 : cuda::DType::kFloat16);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("flash_attention_fwd", &strobe::ops::flash_fwd_cuda);
  m.impl("flash_attention_bwd", &strobe::ops::flash_bwd_cuda);
}
