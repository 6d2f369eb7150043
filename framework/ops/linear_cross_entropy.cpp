// linear_cross_entropy: the language-model head and its cross-entropy in one op that never builds the
// [tokens, vocabulary] logits (docs/OPS.md). Chunk by chunk over the tokens: the chunk's logits (one
// GEMM), its log-sum-exp and loss in fp32, then, when a gradient is wanted, softmax minus one-hot
// written in place, scaled by 1 / (valid tokens) (a device scalar: no host read), and the two GEMMs
// into d hidden's rows and d weight. The backward only scales what the forward computed by the
// incoming gradient. The same ATen code runs on every device (the CPU kernel is the reference); on
// CUDA with 16-bit weights d weight accumulates in fp32 through cuBLAS's bf16 -> fp32 GEMM.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "framework/ops/ops.h"

namespace strobe::ops {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

bool lce_present(const OptTensor& t) { return t.has_value() && t->defined(); }

void lce_check(const Tensor& h, const Tensor& w, const OptTensor& b, const Tensor& target, int64_t chunk_rows) {
  TORCH_CHECK(h.dim() == 2 && w.dim() == 2 && h.sym_size(1) == w.sym_size(1),
              "linear_cross_entropy: hidden must be [N, C] and weight [V, C], got ", h.sym_sizes(), " and ", w.sym_sizes());
  TORCH_CHECK(at::isFloatingType(h.scalar_type()) && w.scalar_type() == h.scalar_type(),
              "linear_cross_entropy: hidden and weight must share a floating dtype, got ", h.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(!lce_present(b) || (b->dim() == 1 && b->sym_size(0) == w.sym_size(0) && b->scalar_type() == w.scalar_type()),
              "linear_cross_entropy: bias must be [V] in weight's dtype");
  TORCH_CHECK(target.dim() == 1 && target.sym_size(0) == h.sym_size(0) && target.scalar_type() == at::kLong,
              "linear_cross_entropy: target must be int64 [N] (", h.sym_size(0), "), got ", target.scalar_type(), " ",
              target.sym_sizes());
  TORCH_CHECK(w.device() == h.device() && target.device() == h.device() && (!lce_present(b) || b->device() == h.device()),
              "linear_cross_entropy: every tensor must be on hidden's device");
  TORCH_CHECK(chunk_rows >= 0, "linear_cross_entropy: chunk_rows must be >= 0 (0: automatic), got ", chunk_rows);
}

// Rows per chunk: chunk_rows, or so that a chunk's fp32 logits stay near 256 MiB (at least 1).
int64_t lce_rows(int64_t chunk_rows, int64_t vocab) {
  if (chunk_rows > 0) return chunk_rows;
  return std::max<int64_t>(1, (int64_t{1} << 26) / std::max<int64_t>(1, vocab));
}

// (loss, dhidden, dweight, dbias): the mean loss over tokens whose target is not ignore_index (fp32;
// fp64 for fp64), and when with_grad the gradients of that loss (dhidden in hidden's dtype, dweight
// and dbias in fp32 / fp64 accumulators).
std::tuple<Tensor, Tensor, Tensor, Tensor> lce_fwd(const Tensor& h, const Tensor& w, const OptTensor& b,
                                                   const Tensor& target, int64_t ignore_index, int64_t chunk_rows,
                                                   bool with_grad) {
  lce_check(h, w, b, target, chunk_rows);
  at::NoGradGuard no_grad;
  const auto cd = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t n = h.size(0), v = w.size(0), rows = lce_rows(chunk_rows, v);
  const Tensor valid = target != ignore_index;
  // Mean over the valid tokens, as PyTorch: 0 / 0 = NaN when none is.
  const Tensor count = valid.sum().to(cd);
  const Tensor inv_count = count.reciprocal();
  Tensor loss_sum = at::zeros({}, h.options().dtype(cd));
  Tensor dh, dw, db;
  const bool lowp_cuda = h.is_cuda() && (h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kHalf);
  if (with_grad) {
    dh = at::empty_like(h, at::MemoryFormat::Contiguous);
    dw = at::zeros(w.sizes(), w.options().dtype(cd));
    if (lce_present(b)) db = at::zeros(b->sizes(), b->options().dtype(cd));
  }
  const Tensor wc = w.contiguous();
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t m = std::min(rows, n - r0);
    const Tensor hc = h.narrow(0, r0, m);
    const Tensor tc = target.narrow(0, r0, m);
    const Tensor vc = valid.narrow(0, r0, m);
    // The chunk's logits as the unfused head computes them (in hidden's dtype), then fp32.
    Tensor logits = at::linear(hc, wc, lce_present(b) ? *b : Tensor()).to(cd);
    const Tensor lse = at::logsumexp(logits, -1);
    const Tensor safe_t = at::where(vc, tc, at::zeros_like(tc));
    const Tensor picked = logits.gather(1, safe_t.unsqueeze(1)).squeeze(1);
    loss_sum += at::where(vc, lse - picked, at::zeros_like(lse)).sum();
    if (!with_grad) continue;
    // softmax - onehot, scaled by valid / count, in place over the chunk's logits.
    logits.sub_(lse.unsqueeze(1)).exp_();
    logits.scatter_add_(1, safe_t.unsqueeze(1), at::full({m, 1}, -1.0, logits.options()));
    logits.mul_((vc.to(cd) * inv_count).unsqueeze(1));
    const Tensor g = logits.to(h.scalar_type());
    dh.narrow(0, r0, m).copy_(at::mm(g, wc));
    if (lowp_cuda) {
      at::addmm_out(dw, dw, g.t(), hc, at::kFloat);  // bf16 / fp16 GEMM accumulating in fp32
    } else {
      dw.addmm_(g.t().to(cd), hc.to(cd));
    }
    if (db.defined()) db.add_(logits.sum(0));
  }
  return {loss_sum * inv_count, dh, dw, db};
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
          lce_present(b) ? at::empty_symint(b->sym_sizes(), b->options().dtype(cd)) : Tensor()};
}

using LceSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
                                                          int64_t, int64_t, bool);
const c10::TypedOperatorHandle<LceSig>& lce_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::linear_cross_entropy_fwd", "").typed<LceSig>();
  return op;
}

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& h, const Tensor& w, const OptTensor& b,
                        const Tensor& target, int64_t ignore_index, int64_t chunk_rows) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const bool with_grad = h.requires_grad() || w.requires_grad() || (lce_present(b) && b->requires_grad());
    auto [loss, dh, dw, db] = lce_fwd_op().call(h, w, b, target, ignore_index, chunk_rows, with_grad);
    ctx->save_for_backward({dh, dw, db});
    ctx->saved_data["w_dtype"] = w.scalar_type();
    return loss;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& g = grads[0];  // a scalar
    const auto wdt = ctx->saved_data["w_dtype"].toScalarType();
    auto scaled = [&](const Tensor& t, at::ScalarType dt) {
      return t.defined() ? (t.to(g.scalar_type()) * g).to(dt) : Tensor();
    };
    return {scaled(saved[0], saved[0].defined() ? saved[0].scalar_type() : wdt), scaled(saved[1], wdt),
            scaled(saved[2], wdt), Tensor(), Tensor(), Tensor()};
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
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("linear_cross_entropy", &strobe::ops::lce_nograd);
  m.impl("linear_cross_entropy_fwd", &strobe::ops::lce_fwd);
}
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("linear_cross_entropy", &strobe::ops::lce_nograd);
  m.impl("linear_cross_entropy_fwd", &strobe::ops::lce_fwd_meta);
}
