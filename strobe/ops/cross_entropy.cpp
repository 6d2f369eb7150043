// cross_entropy: softmax cross-entropy over logits [N, V] with int64 targets, ignore_index and
// mean / sum / none, with a fused forward (per-row logsumexp) and backward (docs/OPS.md). Argument
// checks, the CPU implementation (ATen ops in fp32, fp64 for fp64 logits: the reference), Meta,
// autograd and the C++ wrapper. CUDA kernels: cuda/fused_norm_kernels.cu, glue: cross_entropy_cuda.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/internal.h"
#include "strobe/ops/ops.h"

namespace strobe::ops {
namespace detail {

void cross_entropy_check_inputs(const at::Tensor& logits, const at::Tensor& target) {
  TORCH_CHECK(logits.defined() && target.defined(), "cross_entropy: logits and target must be defined");
  TORCH_CHECK(logits.dim() == 2, "cross_entropy: logits must be [N, V], got ", logits.sym_sizes());
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()), "cross_entropy: logits must be floating, got ",
              logits.scalar_type());
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.sym_size(0) == logits.sym_size(0),
              "cross_entropy: target must be int64 [", logits.sym_size(0), "], got ", target.scalar_type(), " ",
              target.sym_sizes());
  TORCH_CHECK(target.device() == logits.device(), "cross_entropy: target is on ", target.device(), ", logits on ",
              logits.device());
}

}  // namespace detail

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

at::ScalarType ce_loss_dtype(const Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// (loss [N], lse [N]): lse - logits[target] per row, 0 for ignored rows.
std::tuple<Tensor, Tensor> ce_fwd_cpu(const Tensor& logits, const Tensor& target, int64_t ignore_index) {
  detail::cross_entropy_check_inputs(logits, target);
  const Tensor valid = target.ne(ignore_index);
  const int64_t v = logits.size(1);
  TORCH_CHECK(!(valid & (target.lt(0) | target.ge(v))).any().item<bool>(),
              "cross_entropy: a target is outside [0, ", v, ") and not ignore_index (", ignore_index, ")");
  const Tensor lf = logits.to(ce_loss_dtype(logits));
  const Tensor lse = at::logsumexp(lf, {1});
  const Tensor picked = lf.gather(1, at::where(valid, target, 0).unsqueeze(1)).squeeze(1);
  return {at::where(valid, lse - picked, at::zeros({}, lf.options())), lse};
}

Tensor ce_bwd_cpu(const Tensor& grad, const Tensor& logits, const Tensor& target, const Tensor& lse,
               const OptTensor& count, int64_t ignore_index) {
  detail::cross_entropy_check_inputs(logits, target);
  const auto cd = ce_loss_dtype(logits);
  const Tensor valid = target.ne(ignore_index);
  Tensor scale = grad.to(cd);
  if (count.has_value() && count->defined()) scale = scale / count->to(cd);
  scale = scale.dim() == 0 ? scale.expand({logits.size(0)}) : scale;
  scale = at::where(valid, scale, at::zeros({}, scale.options())).unsqueeze(1);
  Tensor d = at::exp(logits.to(cd) - lse.to(cd).unsqueeze(1));
  d.scatter_add_(1, at::where(valid, target, 0).unsqueeze(1),
                 at::where(valid, -1.0, 0.0).to(cd).unsqueeze(1));
  return (d * scale).to(logits.scalar_type());
}

std::tuple<Tensor, Tensor> ce_fwd_meta(const Tensor& logits, const Tensor& target, int64_t ignore_index) {
  (void)ignore_index;
  detail::cross_entropy_check_inputs(logits, target);
  const auto opt = logits.options().dtype(ce_loss_dtype(logits));
  return {at::empty_symint({logits.sym_size(0)}, opt), at::empty_symint({logits.sym_size(0)}, opt)};
}

Tensor ce_bwd_meta(const Tensor& grad, const Tensor& logits, const Tensor& target, const Tensor& lse,
                const OptTensor& count, int64_t ignore_index) {
  (void)grad;
  (void)target;
  (void)lse;
  (void)count;
  (void)ignore_index;
  return at::empty_symint(logits.sym_sizes(), logits.options());
}

using CeFwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, int64_t);
using CeBwdSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&, int64_t);

const c10::TypedOperatorHandle<CeFwdSig>& ce_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::cross_entropy_fwd", "").typed<CeFwdSig>();
  return op;
}
const c10::TypedOperatorHandle<CeBwdSig>& ce_bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::cross_entropy_bwd", "").typed<CeBwdSig>();
  return op;
}

// The reduction over the per-row losses (ATen sums: a fixed order for a given size on a device).
// Returns (loss, count of non-ignored rows as fp32 for mean, else undefined).
std::tuple<Tensor, Tensor> reduce(const Tensor& rows, const Tensor& target, int64_t ignore_index, int64_t r) {
  if (r == detail::kNone) return {rows, Tensor()};
  if (r == detail::kSum) return {rows.sum(), Tensor()};
  // mean over non-ignored rows; 0 of them gives NaN, as PyTorch.
  const Tensor count = target.ne(ignore_index).sum().to(rows.scalar_type());
  return {rows.sum() / count, count};
}

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& logits, const Tensor& target,
                        int64_t ignore_index, std::string_view reduction) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const int64_t r = detail::parse_reduction(reduction, "cross_entropy");
    auto [rows, lse] = ce_fwd_op().call(logits, target, ignore_index);
    auto [loss, count] = reduce(rows, target, ignore_index, r);
    ctx->save_for_backward({logits, target, lse, count});
    ctx->saved_data["ignore_index"] = ignore_index;
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Tensor& go = grads[0];
    if (!go.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const auto s = ctx->get_saved_variables();
    const OptTensor count = s[3].defined() ? OptTensor(s[3]) : std::nullopt;
    const Tensor d = ce_bwd_op().call(go.to(at::kFloat).contiguous(), s[0], s[1], s[2], count,
                                   ctx->saved_data["ignore_index"].toInt());
    return {d, Tensor(), Tensor(), Tensor()};
  }
};

Tensor ce_autograd(const Tensor& logits, const Tensor& target, int64_t ignore_index, std::string_view reduction) {
  return CrossEntropyFunction::apply(logits, target, ignore_index, reduction);
}

Tensor ce_nograd(const Tensor& logits, const Tensor& target, int64_t ignore_index, std::string_view reduction) {
  const int64_t r = detail::parse_reduction(reduction, "cross_entropy");
  auto [rows, lse] = ce_fwd_op().call(logits, target, ignore_index);
  return std::get<0>(reduce(rows, target, ignore_index, r));
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, std::string_view reduction) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::cross_entropy", "")
          .typed<Tensor(const Tensor&, const Tensor&, int64_t, std::string_view)>();
  return op.call(logits, target, ignore_index, reduction);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) { m.impl("cross_entropy", &strobe::ops::ce_autograd); }
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("cross_entropy", &strobe::ops::ce_nograd);
  m.impl("cross_entropy_fwd", &strobe::ops::ce_fwd_cpu);
  m.impl("cross_entropy_bwd", &strobe::ops::ce_bwd_cpu);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) { m.impl("cross_entropy", &strobe::ops::ce_nograd); }
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("cross_entropy", &strobe::ops::ce_nograd);
  m.impl("cross_entropy_fwd", &strobe::ops::ce_fwd_meta);
  m.impl("cross_entropy_bwd", &strobe::ops::ce_bwd_meta);
}
