// linear_cross_entropy: the language-model head and its cross-entropy in one op that never builds the
// [tokens, vocabulary] logits (docs/OPS.md). Chunk by chunk over the tokens: the chunk's logits (one
// GEMM, in hidden's dtype), its log-sum-exp and loss in fp32, then, when a gradient is wanted, softmax
// minus one-hot written in place, scaled by 1 / (valid tokens) (a device scalar: no host read), and
// the two GEMMs into d hidden's rows and d weight. The backward only scales what the forward computed
// by the incoming gradient. On the CPU (the reference) the middle part is ATen ops over fp32 logits;
// on CUDA it is one kernel per chunk (cross_entropy_rows, two reads of the chunk and one write), and
// with 16-bit weights d weight accumulates in fp32 through cuBLAS's bf16 -> fp32 GEMM. The forward
// keeps d weight in that accumulator; the backward scales and rounds it in one pass, then releases it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/ops.h"
#include "strobe/ops/internal.h"

namespace strobe::ops {
#ifdef STROBE_OPS_WITH_CUDA
namespace detail {
void lce_rows_cuda(at::Tensor& logits, const at::Tensor& target, const at::Tensor& inv_count, at::Tensor& loss_rows,
                   int64_t ignore_index, bool grad);
at::Tensor lce_scale_cuda(const at::Tensor& t, const at::Tensor& scale, at::ScalarType dtype);
}  // namespace detail
#endif
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

using detail::present;

void lce_check(const Tensor& h, const Tensor& w, const OptTensor& b, const Tensor& target, int64_t chunk_rows) {
  TORCH_CHECK(h.dim() == 2 && w.dim() == 2 && h.sym_size(1) == w.sym_size(1),
              "linear_cross_entropy: hidden must be [N, C] and weight [V, C], got ", h.sym_sizes(), " and ", w.sym_sizes());
  TORCH_CHECK(at::isFloatingType(h.scalar_type()) && w.scalar_type() == h.scalar_type(),
              "linear_cross_entropy: hidden and weight must share a floating dtype, got ", h.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(!present(b) || (b->dim() == 1 && b->sym_size(0) == w.sym_size(0) && b->scalar_type() == w.scalar_type()),
              "linear_cross_entropy: bias must be [V] in weight's dtype");
  TORCH_CHECK(target.dim() == 1 && target.sym_size(0) == h.sym_size(0) && target.scalar_type() == at::kLong,
              "linear_cross_entropy: target must be int64 [N] (", h.sym_size(0), "), got ", target.scalar_type(), " ",
              target.sym_sizes());
  TORCH_CHECK(w.device() == h.device() && target.device() == h.device() && (!present(b) || b->device() == h.device()),
              "linear_cross_entropy: every tensor must be on hidden's device");
  TORCH_CHECK(chunk_rows >= 0, "linear_cross_entropy: chunk_rows must be >= 0 (0: automatic), got ", chunk_rows);
}

// Rows per chunk: chunk_rows, or so that a chunk's logits stay near `bytes` (at least 1 row; a
// multiple of 128 from 128 rows up, for the GEMMs' tiles).
int64_t lce_rows(int64_t chunk_rows, int64_t vocab, int64_t elem_bytes, int64_t bytes) {
  if (chunk_rows > 0) return chunk_rows;
  const int64_t rows = std::max<int64_t>(1, bytes / std::max<int64_t>(1, vocab * elem_bytes));
  return rows >= 128 ? rows / 128 * 128 : rows;
}

// (loss, dhidden, dweight, dbias): the mean loss over tokens whose target is not ignore_index (fp32;
// fp64 for fp64), and when with_grad the gradients of that loss: dhidden in hidden's dtype, dweight
// and dbias in the dtype they accumulate in (fp32; fp64 for fp64), rounded to the weight's dtype
// by the backward's scaling (one rounding of the scaled value).
std::tuple<Tensor, Tensor, Tensor, Tensor> lce_fwd(const Tensor& h, const Tensor& w, const OptTensor& b,
                                                   const Tensor& target, int64_t ignore_index, int64_t chunk_rows,
                                                   bool with_grad) {
  lce_check(h, w, b, target, chunk_rows);
  at::NoGradGuard no_grad;
  const auto hdt = h.scalar_type();
  const auto cd = hdt == at::kDouble ? at::kDouble : at::kFloat;
#ifdef STROBE_OPS_WITH_CUDA
  // CUDA: one kernel per chunk for the loss and softmax - onehot (in place over the chunk's logits).
  const bool kernel = h.is_cuda() && hdt != at::kDouble;
#else
  const bool kernel = false;
#endif
  const int64_t n = h.size(0), v = w.size(0);
  // The ATen path's fp32 logits near 256 MiB a chunk (523 rows at 128,256 tokens -> 512); the kernel's
  // 16-bit logits near 512 MiB (2,048 rows: at 1,024 the GEMMs ran 10% slower on an H200, at 4,096
  // no faster and d weight's fp32 accumulator no longer bounds the peak; docs/PERFORMANCE.md).
  const int64_t rows = kernel ? lce_rows(chunk_rows, v, h.element_size(), int64_t{1} << 29)
                              : lce_rows(chunk_rows, v, at::elementSize(cd), int64_t{1} << 28);
  const Tensor tgt = target.contiguous();
  const Tensor valid = tgt != ignore_index;
  // Mean over the valid tokens, as PyTorch: 0 / 0 = NaN when none is.
  const Tensor count = valid.sum().to(cd);
  const Tensor inv_count = count.reciprocal();
  const bool lowp_cuda = h.is_cuda() && (hdt == at::kBFloat16 || hdt == at::kHalf);
  Tensor loss_sum = kernel ? Tensor() : at::zeros({}, h.options().dtype(cd));
  Tensor loss_rows = kernel ? at::empty({n}, h.options().dtype(at::kFloat)) : Tensor();
  Tensor dh, dw, db;
  if (with_grad) {
    dh = at::empty(h.sizes(), h.options().memory_format(at::MemoryFormat::Contiguous));
    // d weight: written by the first chunk's GEMM, accumulated by the others (zeros if no chunk).
    dw = n == 0 ? at::zeros(w.sizes(), w.options().dtype(cd)) : at::empty(w.sizes(), w.options().dtype(cd));
    if (present(b)) db = at::zeros(b->sizes(), b->options().dtype(cd));
  }
  const Tensor wc = w.contiguous();
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t m = std::min(rows, n - r0);
    const Tensor hc = h.narrow(0, r0, m);
    const Tensor tc = tgt.narrow(0, r0, m);
    // The chunk's logits as the unfused head computes them, in hidden's dtype.
    Tensor z = at::linear(hc, wc, present(b) ? *b : Tensor());
    Tensor g;  // d logits of the chunk, in hidden's dtype
#ifdef STROBE_OPS_WITH_CUDA
    if (kernel) {
      Tensor lr = loss_rows.narrow(0, r0, m);
      detail::lce_rows_cuda(z, tc, inv_count, lr, ignore_index, with_grad);  // kernel: cd is fp32
      if (!with_grad) continue;
      g = z;
      if (db.defined()) db.add_(at::sum(g, {0}, false, cd));
    }
#endif
    if (!kernel) {
      const Tensor vc = valid.narrow(0, r0, m);
      Tensor logits = z.to(cd);
      const Tensor lse = at::logsumexp(logits, -1);
      const Tensor safe_t = at::where(vc, tc, at::zeros_like(tc));
      const Tensor picked = logits.gather(1, safe_t.unsqueeze(1)).squeeze(1);
      loss_sum += at::where(vc, lse - picked, at::zeros_like(lse)).sum();
      if (!with_grad) continue;
      // softmax - onehot, scaled by 1 / count (0 for an ignored row), in place over the chunk's logits.
      logits.sub_(lse.unsqueeze(1)).exp_();
      logits.scatter_add_(1, safe_t.unsqueeze(1), at::full({m, 1}, -1.0, logits.options()));
      logits.mul_(at::where(vc, inv_count, at::zeros_like(inv_count)).unsqueeze(1));  // ignored rows: 0, as PyTorch
      g = logits.to(hdt);
      if (db.defined()) db.add_(logits.sum(0));
    }
    Tensor dh_rows = dh.narrow(0, r0, m);
    at::mm_out(dh_rows, g, wc);
    if (lowp_cuda) {  // bf16 / fp16 GEMM with an fp32 output
      if (r0 == 0) at::mm_out(dw, g.t(), hc, at::kFloat);
      else at::addmm_out(dw, dw, g.t(), hc, at::kFloat);
    } else if (r0 == 0) {
      at::mm_out(dw, g.t().to(cd), hc.to(cd));
    } else {
      dw.addmm_(g.t().to(cd), hc.to(cd));
    }
  }
  Tensor loss = kernel ? loss_rows.sum() * inv_count : loss_sum * inv_count;
  if (!with_grad) return {loss, Tensor(), Tensor(), Tensor()};
  return {loss, dh, dw, db};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> lce_fwd_meta(const Tensor& h, const Tensor& w, const OptTensor& b,
                                                        const Tensor& target, int64_t ignore_index, int64_t chunk_rows,
                                                        bool with_grad) {
  (void)ignore_index;
  lce_check(h, w, b, target, chunk_rows);
  const auto cd = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Tensor loss = at::empty({}, h.options().dtype(cd));
  if (!with_grad) return {loss, Tensor(), Tensor(), Tensor()};
  return {loss, at::empty_symint(h.sym_sizes(), h.options()), at::empty_symint(w.sym_sizes(), w.options().dtype(cd)),
          present(b) ? at::empty_symint(b->sym_sizes(), b->options().dtype(cd)) : Tensor()};
}

using LceSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
                                                          int64_t, int64_t, bool);
const c10::TypedOperatorHandle<LceSig>& lce_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::linear_cross_entropy_fwd", "").typed<LceSig>();
  return op;
}

// t * g rounded once to dtype (t: dtype itself, or its fp32 / fp64 accumulator), g a scalar tensor.
Tensor lce_scale(const Tensor& t, const Tensor& g, at::ScalarType dtype) {
#ifdef STROBE_OPS_WITH_CUDA
  // CUDA: one vectorised kernel that reads the fp32 scalar on the device and rounds from fp32 in the
  // same pass (ATen's mixed-dtype multiply is a generic, unvectorised kernel: ~1 ms for
  // Llama-3.2-1B's head weight, and a separate rounding another pass over it).
  if (t.is_cuda() && g.is_cuda() && g.scalar_type() == at::kFloat && t.is_contiguous() && t.scalar_type() != at::kDouble &&
      dtype != at::kDouble && (t.scalar_type() == dtype || t.scalar_type() == at::kFloat))
    return detail::lce_scale_cuda(t, g, dtype);
#endif
  return (t * g.to(t.device())).to(dtype);
}
Tensor lce_scale_meta(const Tensor& t, const Tensor& /*g*/, at::ScalarType dtype) { return at::empty_like(t, t.options().dtype(dtype)); }

using LceScaleSig = Tensor(const Tensor&, const Tensor&, at::ScalarType);
const c10::TypedOperatorHandle<LceScaleSig>& lce_scale_op() {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("strobe::linear_cross_entropy_scale", "")
                              .typed<LceScaleSig>();
  return op;
}

// The forward computes the gradients; they wait in saved_data (not save_for_backward: the backward
// releases d weight's fp32 accumulator as soon as it has rounded it, rather than when the node dies).
class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& h, const Tensor& w, const OptTensor& b,
                        const Tensor& target, int64_t ignore_index, int64_t chunk_rows) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const bool with_grad = h.requires_grad() || w.requires_grad() || (present(b) && b->requires_grad());
    auto [loss, dh, dw, db] = lce_fwd_op().call(h, w, b, target, ignore_index, chunk_rows, with_grad);
    ctx->saved_data["dh"] = dh;
    ctx->saved_data["dw"] = dw;
    ctx->saved_data["db"] = db;
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    return loss;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(ctx->saved_data.count("dw"),
                "linear_cross_entropy: a second backward through the same forward (retain_graph) is not supported: "
                "its gradients are made by the forward and released by the first backward");
    const Tensor& g = grads[0];  // a scalar
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    // Each gradient times the incoming scalar, rounded once to its input's dtype; each saved gradient
    // released once scaled (d weight first: its fp32 accumulator is the largest).
    auto take = [&](const char* key, int input, std::optional<at::ScalarType> dtype) {
      const c10::IValue v = ctx->saved_data[key];
      ctx->saved_data.erase(key);
      const Tensor t = v.isTensor() ? v.toTensor() : Tensor();
      return t.defined() && ctx->needs_input_grad(input) ? lce_scale_op().call(t, g, dtype.value_or(t.scalar_type()))
                                                         : Tensor();
    };
    Tensor dw = take("dw", 1, w_dtype);
    Tensor db = take("db", 2, w_dtype);
    Tensor dh = take("dh", 0, std::nullopt);
    return {dh, dw, db, Tensor(), Tensor(), Tensor()};
  }
};

Tensor lce_autograd(const Tensor& h, const Tensor& w, const OptTensor& b, const Tensor& target, int64_t ignore_index,
                    int64_t chunk_rows) {
  return LinearCrossEntropyFunction::apply(h, w, b, target, ignore_index, chunk_rows);
}
Tensor lce_nograd(const Tensor& h, const Tensor& w, const OptTensor& b, const Tensor& target, int64_t ignore_index,
                  int64_t chunk_rows) {
  return std::get<0>(lce_fwd_op().call(h, w, b, target, ignore_index, chunk_rows, false));
}

}  // namespace

Tensor linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const std::optional<Tensor>& bias,
                            const Tensor& target, int64_t ignore_index, int64_t chunk_rows) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::linear_cross_entropy", "")
                             .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, int64_t, int64_t)>();
  return op.call(hidden, weight, bias, target, ignore_index, chunk_rows);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) { m.impl("linear_cross_entropy", &strobe::ops::lce_autograd); }
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("linear_cross_entropy", &strobe::ops::lce_nograd);
  m.impl("linear_cross_entropy_fwd", &strobe::ops::lce_fwd);
  m.impl("linear_cross_entropy_scale", &strobe::ops::lce_scale);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("linear_cross_entropy", &strobe::ops::lce_nograd);
  m.impl("linear_cross_entropy_fwd", &strobe::ops::lce_fwd);
  m.impl("linear_cross_entropy_scale", &strobe::ops::lce_scale);
}
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("linear_cross_entropy", &strobe::ops::lce_nograd);
  m.impl("linear_cross_entropy_fwd", &strobe::ops::lce_fwd_meta);
  m.impl("linear_cross_entropy_scale", &strobe::ops::lce_scale_meta);
}
