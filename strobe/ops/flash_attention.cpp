// flash_attention: argument checks shared by every device, the reference implementation (ATen ops,
// the CPU kernel of the op and the models' `math` backend), autograd, and the Meta (fake) kernels.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "strobe/ops/flash_attention_internal.h"
#include "strobe/ops/ops.h"

namespace strobe::ops {

using at::Tensor;

namespace detail {

FlashShape flash_check_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                              const std::optional<Tensor>& cu_seqlens_q,
                              const std::optional<Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                              int64_t max_seqlen_k, double softmax_scale) {
  constexpr const char* op = "flash_attention";
  TORCH_CHECK(q.defined() && k.defined() && v.defined(), op, ": q, k and v must be defined");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
              ": q, k and v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(),
              ", ", v.scalar_type());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), op, ": q must be floating point, got ",
              q.scalar_type());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), op,
              ": q, k and v must be on one device, got ", q.device(), ", ", k.device(), ", ",
              v.device());
  const bool has_q = cu_seqlens_q.has_value() && cu_seqlens_q->defined();
  const bool has_k = cu_seqlens_k.has_value() && cu_seqlens_k->defined();
  TORCH_CHECK(has_q == has_k, op, ": give both cu_seqlens_q and cu_seqlens_k or neither");
  FlashShape s;
  s.varlen = has_q;
  if (!s.varlen) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
                ": q, k, v must be [B, S, H, D] (or [T, H, D] with cu_seqlens), got ", q.sizes(),
                ", ", k.sizes(), ", ", v.sizes());
    s.batch = q.size(0);
    s.seqlen_q = q.size(1);
    s.seqlen_k = k.size(1);
    TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch, op,
                ": q, k, v must have the same batch size, got ", q.sizes(), ", ", k.sizes(), ", ",
                v.sizes());
    TORCH_CHECK(v.size(1) == s.seqlen_k, op, ": k and v must have the same length, got ",
                k.sizes(), " and ", v.sizes());
    TORCH_CHECK(max_seqlen_q == 0 || max_seqlen_q == s.seqlen_q, op,
                ": max_seqlen_q is for varlen inputs (0 or the sequence length), got ",
                max_seqlen_q);
    TORCH_CHECK(max_seqlen_k == 0 || max_seqlen_k == s.seqlen_k, op,
                ": max_seqlen_k is for varlen inputs (0 or the sequence length), got ",
                max_seqlen_k);
  } else {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
                ": with cu_seqlens, q, k, v must be packed [T, H, D], got ", q.sizes(), ", ",
                k.sizes(), ", ", v.sizes());
    TORCH_CHECK(k.size(0) == v.size(0), op, ": k and v must have the same rows, got ", k.sizes(),
                " and ", v.sizes());
    for (const Tensor* cu : {&*cu_seqlens_q, &*cu_seqlens_k}) {
      TORCH_CHECK(cu->scalar_type() == at::kInt, op, ": cu_seqlens must be int32, got ",
                  cu->scalar_type());
      TORCH_CHECK(cu->dim() == 1 && cu->size(0) >= 2, op, ": cu_seqlens must be [B + 1], got ",
                  cu->sizes());
      TORCH_CHECK(cu->device() == q.device(), op, ": cu_seqlens are on ", cu->device(),
                  " but q is on ", q.device());
    }
    TORCH_CHECK(cu_seqlens_q->size(0) == cu_seqlens_k->size(0), op,
                ": cu_seqlens_q and cu_seqlens_k must have the same length, got ",
                cu_seqlens_q->size(0), " and ", cu_seqlens_k->size(0));
    TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, op, ": max_seqlen must be >= 0");
    s.batch = cu_seqlens_q->size(0) - 1;
    s.seqlen_q = max_seqlen_q;
    s.seqlen_k = max_seqlen_k;
    if (cu_seqlens_q->device().is_cpu()) {
      // Cheap on CPU; on CUDA reading them would sync (the kernels trust them, see docs/OPS.md).
      auto check_cu = [&](const Tensor& cu, int64_t rows, int64_t max_len, const char* name) {
        const Tensor c = cu.contiguous();
        const int* p = c.data_ptr<int>();
        TORCH_CHECK(p[0] == 0, op, ": ", name, "[0] must be 0, got ", p[0]);
        for (int64_t i = 0; i + 1 < c.size(0); ++i) {
          TORCH_CHECK(p[i + 1] >= p[i], op, ": ", name, " must be non-decreasing (at ", i, ")");
          TORCH_CHECK(p[i + 1] - p[i] <= max_len, op, ": sequence ", i, " has ", p[i + 1] - p[i],
                      " rows, more than ", name == std::string("cu_seqlens_q") ? "max_seqlen_q"
                                                                              : "max_seqlen_k",
                      " = ", max_len);
        }
        TORCH_CHECK(p[c.size(0) - 1] <= rows, op, ": ", name, "[-1] = ", p[c.size(0) - 1],
                    " exceeds the ", rows, " packed rows");
      };
      check_cu(*cu_seqlens_q, q.size(0), max_seqlen_q, "cu_seqlens_q");
      check_cu(*cu_seqlens_k, k.size(0), max_seqlen_k, "cu_seqlens_k");
    }
  }
  const int64_t hd = q.dim() - 2;
  s.heads = q.size(hd);
  s.head_dim = q.size(-1);
  TORCH_CHECK(k.size(hd) == s.heads && v.size(hd) == s.heads, op,
              ": q, k, v must have the same number of heads (grouped-query attention is not "
              "supported), got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.size(-1) == s.head_dim && v.size(-1) == s.head_dim, op,
              ": q, k, v must have the same head_dim, got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, op,
              ": softmax_scale must be a positive finite number, got ", softmax_scale);
  return s;
}

double resolve_scale(const Tensor& q, std::optional<double> softmax_scale) {
  return softmax_scale.has_value() ? *softmax_scale
                                   : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

}  // namespace detail

namespace {

// The reference works on padded [n, H, S, D] tensors in the compute dtype (fp64 for fp64 inputs,
// fp32 otherwise) with an "allowed" mask [n|1, 1, Sq, Sk]; varlen inputs are gathered into that
// form and scattered back without reading cu_seqlens on the host.
struct Padded {
  Tensor q, k, v;  // [n, H, S, D], compute dtype
  Tensor allowed;  // [n|1, 1, Sq, Sk] bool
  // Varlen only: flat padded row of every packed row, [Tq] / [Tk] int64.
  Tensor q_rows, k_rows;
  int64_t n = 0, max_q = 0, max_k = 0;
};

// Gather index [n, max_len] of the padded rows (clamped to a real row) and their validity.
std::pair<Tensor, Tensor> unpack_index(const Tensor& cu, int64_t max_len, int64_t total) {
  const Tensor starts = cu.slice(0, 0, -1), lengths = cu.slice(0, 1) - starts;
  const Tensor pos = at::arange(max_len, cu.options());
  const Tensor keep = pos.unsqueeze(0) < lengths.unsqueeze(1);
  const Tensor index =
      (starts.unsqueeze(1) + pos.unsqueeze(0)).clamp(0, std::max<int64_t>(total - 1, 0));
  return {index, keep};
}
// Flat padded row (seq * max_len + pos) of every packed row t < cu[-1]; rows past cu[-1] (unused
// tail) map to row 0 and are zeroed by the caller.
Tensor packed_rows(const Tensor& cu, int64_t max_len, int64_t total) {
  const Tensor t = at::arange(total, cu.options());
  const Tensor seq = at::searchsorted(cu.slice(0, 1), t, /*out_int32=*/false, /*right=*/true)
                         .clamp_max(cu.size(0) - 2);
  const Tensor pos = t - cu.index_select(0, seq);
  return at::where(t < cu.select(0, -1), seq * max_len + pos, at::zeros_like(t));
}

Padded make_padded(const Tensor& q, const Tensor& k, const Tensor& v,
                   const std::optional<Tensor>& cu_seqlens_q,
                   const std::optional<Tensor>& cu_seqlens_k, int64_t max_q, int64_t max_k,
                   bool causal, bool varlen) {
  const auto cdt = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Padded p;
  const auto bopt = q.options().dtype(at::kBool);
  if (!varlen) {
    p.q = q.to(cdt).transpose(1, 2);
    p.k = k.to(cdt).transpose(1, 2);
    p.v = v.to(cdt).transpose(1, 2);
    p.n = q.size(0);
    p.max_q = q.size(1);
    p.max_k = k.size(1);
    p.allowed = at::ones({1, 1, p.max_q, p.max_k}, bopt);
    if (causal) {
      p.allowed = p.allowed.tril(p.max_k - p.max_q);  // bottom-right aligned
    }
    return p;
  }
  const Tensor cq = cu_seqlens_q->to(at::kLong), ck = cu_seqlens_k->to(at::kLong);
  p.n = cq.size(0) - 1;
  p.max_q = max_q;
  p.max_k = max_k;
  auto [iq, keep_q] = unpack_index(cq, max_q, q.size(0));
  auto [ik, keep_k] = unpack_index(ck, max_k, k.size(0));
  auto unpack = [&](const Tensor& x, const Tensor& index, int64_t len) {
    if (x.size(0) == 0) return at::zeros({p.n, x.size(1), len, x.size(2)}, x.options().dtype(cdt));
    return x.to(cdt).index_select(0, index.flatten()).view({p.n, len, x.size(1), x.size(2)}).transpose(1, 2);
  };
  p.q = unpack(q, iq, max_q);
  p.k = unpack(k, ik, max_k);
  p.v = unpack(v, ik, max_k);
  Tensor allowed = keep_q.view({p.n, 1, max_q, 1}) & keep_k.view({p.n, 1, 1, max_k});
  if (causal) {
    const Tensor len_q = (cq.slice(0, 1) - cq.slice(0, 0, -1)).view({p.n, 1, 1, 1});
    const Tensor len_k = (ck.slice(0, 1) - ck.slice(0, 0, -1)).view({p.n, 1, 1, 1});
    const Tensor row = at::arange(max_q, cq.options()).view({1, 1, max_q, 1});
    const Tensor col = at::arange(max_k, cq.options()).view({1, 1, 1, max_k});
    allowed = allowed & (col <= row + len_k - len_q);
  }
  p.allowed = allowed;
  p.q_rows = packed_rows(cq, max_q, q.size(0));
  p.k_rows = packed_rows(ck, max_k, k.size(0));
  return p;
}

// [n, H, S, D] -> packed [T, H, D] (varlen) or [n, S, H, D]; rows past cu[-1] are zero.
Tensor pack_rows(const Padded& p, const Tensor& x, const Tensor& rows, const Tensor& cu,
                 int64_t total) {
  const Tensor flat = x.transpose(1, 2).reshape({-1, x.size(1), x.size(3)});
  if (total == 0 || flat.size(0) == 0) return at::zeros({total, x.size(1), x.size(3)}, x.options());
  const Tensor used = at::arange(total, rows.options()) < cu.to(at::kLong).select(0, -1);
  return flat.index_select(0, rows) * used.view({-1, 1, 1}).to(x.scalar_type());
}

// Probabilities and LSE of the padded problem: P [n, H, Sq, Sk] and LSE [n, H, Sq]; a row with no
// allowed key gets P = 0 and LSE = +inf (and no NaN in autograd's backward either).
std::pair<Tensor, Tensor> probabilities(const Padded& p, double scale) {
  const Tensor scores = at::matmul(p.q, p.k.transpose(-2, -1)) * scale;
  const double ninf = -std::numeric_limits<double>::infinity();
  const Tensor masked = scores.masked_fill(p.allowed.logical_not(), ninf);
  const Tensor mx = std::get<0>(masked.max(-1, /*keepdim=*/true)).detach();
  const Tensor m_safe = at::where(at::isinf(mx), at::zeros_like(mx), mx);
  const Tensor e = at::exp(masked - m_safe);
  const Tensor l = e.sum(-1, /*keepdim=*/true);
  const Tensor empty = l == 0;
  const Tensor l_safe = at::where(empty, at::ones_like(l), l);
  const Tensor probs = e / l_safe;
  const Tensor lse = at::where(empty, at::full_like(l, std::numeric_limits<double>::infinity()),
                               m_safe + at::log(l_safe))
                         .squeeze(-1);
  return {probs, lse};
}

at::ScalarType lse_dtype(const Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

std::tuple<Tensor, Tensor> flash_attention_reference(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& cu_seqlens_q,
    const std::optional<Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool causal, std::optional<double> softmax_scale) {
  const double scale = detail::resolve_scale(q, softmax_scale);
  const detail::FlashShape s = detail::flash_check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                          max_seqlen_q, max_seqlen_k, scale);
  const Padded p =
      make_padded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, s.varlen);
  auto [probs, lse] = probabilities(p, scale);
  const Tensor out = at::matmul(probs, p.v);  // [n, H, Sq, D]
  if (!s.varlen) {
    return {out.transpose(1, 2).to(q.scalar_type()), lse.to(lse_dtype(q))};
  }
  const Tensor out_packed = pack_rows(p, out, p.q_rows, *cu_seqlens_q, q.size(0));
  // LSE [H, Tq]: rows past cu[-1] are +inf (no keys).
  const Tensor lse_flat = lse.permute({1, 0, 2}).reshape({s.heads, -1});
  Tensor lse_packed;
  if (q.size(0) == 0 || lse_flat.size(1) == 0) {
    lse_packed = at::full({s.heads, q.size(0)}, std::numeric_limits<double>::infinity(),
                          lse.options());
  } else {
    const Tensor used = at::arange(q.size(0), p.q_rows.options()) <
                        cu_seqlens_q->to(at::kLong).select(0, -1);
    lse_packed = at::where(used.unsqueeze(0), lse_flat.index_select(1, p.q_rows),
                           at::full_like(lse_flat.index_select(1, p.q_rows),
                                         std::numeric_limits<double>::infinity()));
  }
  return {out_packed.to(q.scalar_type()), lse_packed.to(lse_dtype(q))};
}

namespace {

std::tuple<Tensor, Tensor> flash_fwd_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const std::optional<Tensor>& cu_seqlens_q,
                                         const std::optional<Tensor>& cu_seqlens_k,
                                         int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                         double softmax_scale) {
  // Contiguous, as the CUDA kernels and the Meta kernel return them.
  auto [out, lse] = flash_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, causal, softmax_scale);
  return {out.contiguous(), lse.contiguous()};
}

// Backward of the reference in closed form: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP)),
// dQ = scale dS K, dK = scale dS^T Q (P recomputed; `out` and `lse` are not needed).
std::tuple<Tensor, Tensor, Tensor> flash_bwd_cpu(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const std::optional<Tensor>& cu_seqlens_q,
    const std::optional<Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool causal, double softmax_scale, bool deterministic) {
  (void)out;
  (void)lse;
  (void)deterministic;  // the reference is deterministic
  const detail::FlashShape s = detail::flash_check_inputs(
      q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale);
  TORCH_CHECK(grad_out.sizes() == q.sizes(), "flash_attention backward: grad_out ",
              grad_out.sizes(), " must match q ", q.sizes());
  const at::NoGradGuard no_grad;
  const Padded p = make_padded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, s.varlen);
  const Tensor probs = probabilities(p, softmax_scale).first;
  Tensor d_o;  // [n, H, Sq, D]
  if (!s.varlen) {
    d_o = grad_out.to(p.q.scalar_type()).transpose(1, 2);
  } else {
    auto [iq, keep_q] = unpack_index(cu_seqlens_q->to(at::kLong), max_seqlen_q, q.size(0));
    const Tensor g = grad_out.to(p.q.scalar_type());
    d_o = g.size(0) == 0 ? at::zeros_like(p.q)
                         : g.index_select(0, iq.flatten())
                               .view({p.n, max_seqlen_q, s.heads, s.head_dim})
                               .transpose(1, 2) *
                               keep_q.view({p.n, 1, max_seqlen_q, 1}).to(g.scalar_type());
  }
  const Tensor dv = at::matmul(probs.transpose(-2, -1), d_o);
  const Tensor dp = at::matmul(d_o, p.v.transpose(-2, -1));
  const Tensor ds = probs * (dp - (probs * dp).sum(-1, /*keepdim=*/true));
  const Tensor dq = at::matmul(ds, p.k) * softmax_scale;
  const Tensor dk = at::matmul(ds.transpose(-2, -1), p.q) * softmax_scale;
  if (!s.varlen) {
    return {dq.transpose(1, 2).to(q.scalar_type()).contiguous(),
            dk.transpose(1, 2).to(k.scalar_type()).contiguous(),
            dv.transpose(1, 2).to(v.scalar_type()).contiguous()};
  }
  return {pack_rows(p, dq, p.q_rows, *cu_seqlens_q, q.size(0)).to(q.scalar_type()),
          pack_rows(p, dk, p.k_rows, *cu_seqlens_k, k.size(0)).to(k.scalar_type()),
          pack_rows(p, dv, p.k_rows, *cu_seqlens_k, v.size(0)).to(v.scalar_type())};
}

// ---- Meta (fake) kernels: shapes and dtypes only ---------------------------------------------------
std::tuple<Tensor, Tensor> flash_fwd_meta(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const std::optional<Tensor>& cu_seqlens_q,
                                          const std::optional<Tensor>& cu_seqlens_k,
                                          int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                          double softmax_scale) {
  (void)causal;
  const detail::FlashShape s = detail::flash_check_inputs(
      q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale);
  // Symbolic sizes (torch.compile with dynamic shapes) flow through: sym_sizes, no sizes().
  const Tensor out = at::empty_symint(q.sym_sizes(), q.options());
  const auto lopt = q.options().dtype(lse_dtype(q));
  const c10::SymInt heads = q.sym_size(-2);
  const Tensor lse = s.varlen ? at::empty_symint({heads, q.sym_size(0)}, lopt)
                              : at::empty_symint({q.sym_size(0), heads, q.sym_size(1)}, lopt);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> flash_bwd_meta(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const std::optional<Tensor>& cu_seqlens_q,
    const std::optional<Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool causal, double softmax_scale, bool deterministic) {
  (void)grad_out, (void)out, (void)lse, (void)causal, (void)deterministic;
  detail::flash_check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale);
  auto like = [](const Tensor& t) { return at::empty_symint(t.sym_sizes(), t.options()); };
  return {like(q), like(k), like(v)};
}

// ---- Autograd ------------------------------------------------------------------------------------
using FwdFn = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                         const std::optional<Tensor>&,
                                         const std::optional<Tensor>&, int64_t, int64_t, bool,
                                         double);
using BwdFn = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, const Tensor&, const Tensor&,
                                                 const std::optional<Tensor>&,
                                                 const std::optional<Tensor>&, int64_t, int64_t,
                                                 bool, double, bool);

const c10::TypedOperatorHandle<FwdFn>& fa_fwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::flash_attention_fwd", "")
                             .typed<FwdFn>();
  return op;
}
const c10::TypedOperatorHandle<BwdFn>& fa_bwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::flash_attention_bwd", "")
                             .typed<BwdFn>();
  return op;
}

class FlashAttentionFunction : public torch::autograd::Function<FlashAttentionFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
      const std::optional<Tensor>& cu_seqlens_q, const std::optional<Tensor>& cu_seqlens_k,
      int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, double softmax_scale,
      bool deterministic) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = fa_fwd_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, softmax_scale);
    const bool varlen = cu_seqlens_q.has_value() && cu_seqlens_q->defined();
    ctx->save_for_backward({q, k, v, out, lse, varlen ? *cu_seqlens_q : Tensor(),
                            varlen ? *cu_seqlens_k : Tensor()});
    ctx->saved_data["max_q"] = max_seqlen_q;
    ctx->saved_data["max_k"] = max_seqlen_k;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = softmax_scale;
    ctx->saved_data["det"] = deterministic;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& grad_out = grads[0];
    torch::autograd::variable_list none(10);
    if (!grad_out.defined()) return none;
    std::optional<Tensor> cq, ck;
    if (saved[5].defined()) {
      cq = saved[5];
      ck = saved[6];
    }
    auto [dq, dk, dv] = fa_bwd_op().call(
        grad_out.contiguous(), saved[0], saved[1], saved[2], saved[3], saved[4], cq, ck,
        ctx->saved_data["max_q"].toInt(), ctx->saved_data["max_k"].toInt(),
        ctx->saved_data["causal"].toBool(), ctx->saved_data["scale"].toDouble(),
        ctx->saved_data["det"].toBool());
    none[0] = dq;
    none[1] = dk;
    none[2] = dv;
    return none;
  }
};

std::tuple<Tensor, Tensor> flash_attention_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& cu_seqlens_q,
    const std::optional<Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool causal, std::optional<double> softmax_scale, bool deterministic) {
  auto r = FlashAttentionFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, causal,
                                         detail::resolve_scale(q, softmax_scale), deterministic);
  return {r[0], r[1]};
}

std::tuple<Tensor, Tensor> flash_attention_nograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& cu_seqlens_q,
    const std::optional<Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool causal, std::optional<double> softmax_scale, bool deterministic) {
  (void)deterministic;
  return fa_fwd_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       detail::resolve_scale(q, softmax_scale));
}

}  // namespace

std::tuple<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                           bool causal, std::optional<double> softmax_scale,
                                           bool deterministic) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::flash_attention", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                            const std::optional<Tensor>&,
                                            const std::optional<Tensor>&, int64_t, int64_t, bool,
                                            std::optional<double>, bool)>();
  return op.call(q, k, v, std::nullopt, std::nullopt, 0, 0, causal, softmax_scale, deterministic);
}

std::tuple<Tensor, Tensor> flash_attention_varlen(const Tensor& q, const Tensor& k,
                                                  const Tensor& v, const Tensor& cu_seqlens_q,
                                                  const Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                  int64_t max_seqlen_k, bool causal,
                                                  std::optional<double> softmax_scale,
                                                  bool deterministic) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::flash_attention", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                            const std::optional<Tensor>&,
                                            const std::optional<Tensor>&, int64_t, int64_t, bool,
                                            std::optional<double>, bool)>();
  return op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 softmax_scale, deterministic);
}

#ifndef STROBE_OPS_WITH_CUDA
bool flash_attention_uses_wgmma() { return false; }
bool flash_attention_cuda_takes(int64_t, torch::ScalarType) { return false; }
#endif

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) {
  m.impl("flash_attention", &strobe::ops::flash_attention_autograd);
}
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("flash_attention", &strobe::ops::flash_attention_nograd);
  m.impl("flash_attention_fwd", &strobe::ops::flash_fwd_cpu);
  m.impl("flash_attention_bwd", &strobe::ops::flash_bwd_cpu);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("flash_attention", &strobe::ops::flash_attention_nograd);
}
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("flash_attention", &strobe::ops::flash_attention_nograd);
  m.impl("flash_attention_fwd", &strobe::ops::flash_fwd_meta);
  m.impl("flash_attention_bwd", &strobe::ops::flash_bwd_meta);
}
