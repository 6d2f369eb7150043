// rotary_qk: the rotary position embedding of q and k in Hugging Face's rotate-half convention and
// numerics (docs/OPS.md), forward and backward. Argument checks shared by every device, the CPU
// implementation (ATen, the same ops and roundings as transformers' apply_rotary_pos_emb and its
// autograd backward: the reference), the Meta kernel, autograd and the C++ wrapper. CUDA kernel:
// cuda/rotary_kernels.cu, glue: rotary_cuda.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/ops.h"

namespace strobe::ops {
namespace detail {

// Used by the CUDA glue too.
void rotary_check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.defined() && k.defined() && cos.defined() && sin.defined(), "rotary_qk: q, k, cos and sin must be defined");
  TORCH_CHECK(q.dim() >= 2 && k.dim() == q.dim(), "rotary_qk: q and k must be [..., heads, head_dim] of one rank, got ",
              q.sym_sizes(), " and ", k.sym_sizes());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()) && k.scalar_type() == q.scalar_type(),
              "rotary_qk: q and k must share a floating dtype, got ", q.scalar_type(), " and ", k.scalar_type());
  const c10::SymInt& d = q.sym_size(-1);
  TORCH_CHECK(k.sym_size(-1) == d && d % 2 == 0, "rotary_qk: q and k need one even head_dim, got ", d, " and ",
              k.sym_size(-1));
  // Leading dimensions (the tokens) equal for q, k, cos and sin: cos / sin are [..., head_dim].
  const auto lead = q.sym_sizes().slice(0, q.dim() - 2);
  TORCH_CHECK(k.sym_sizes().slice(0, k.dim() - 2) == lead, "rotary_qk: q and k must share their leading dimensions, got ",
              q.sym_sizes(), " and ", k.sym_sizes());
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == q.dim() - 1 && t->sym_sizes().slice(0, t->dim() - 1) == lead && t->sym_size(-1) == d,
                "rotary_qk: cos and sin must be ", lead, " x ", d, " (one row per token), got ", t->sym_sizes());
    TORCH_CHECK(at::isFloatingType(t->scalar_type()) && t->device() == q.device(),
                "rotary_qk: cos and sin must be floating tensors on q's device");
  }
  TORCH_CHECK(k.device() == q.device(), "rotary_qk: q is on ", q.device(), ", k on ", k.device());
}

}  // namespace detail

namespace {

using at::Tensor;

// HF's rotate_half and its transpose (the backward of cat(-x2, x1)): exact, no rounding.
Tensor rot_half(const Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}
Tensor rot_half_t(const Tensor& g) {
  const int64_t h = g.size(-1) / 2;
  return at::cat({g.narrow(-1, h, h), -g.narrow(-1, 0, h)}, -1);
}

// (q', k'): backward false applies the rotation, true its inverse (the gradient of the forward).
std::tuple<Tensor, Tensor> rot_apply_cpu(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                         bool backward) {
  detail::rotary_check_inputs(q, k, cos, sin);
  const auto c = cos.unsqueeze(-2).to(q.scalar_type()), s = sin.unsqueeze(-2).to(q.scalar_type());
  auto one = [&](const Tensor& x) {
    // Forward: x * c + rotate_half(x) * s. Backward, as autograd computes it: dy * c + rotate_half^T(dy * s).
    return backward ? x * c + rot_half_t(x * s) : x * c + rot_half(x) * s;
  };
  return {one(q), one(k)};
}

std::tuple<Tensor, Tensor> rot_apply_meta(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                          bool backward) {
  (void)backward;
  detail::rotary_check_inputs(q, k, cos, sin);
  return {at::empty_symint(q.sym_sizes(), q.options()), at::empty_symint(k.sym_sizes(), k.options())};
}

using RotSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);
const c10::TypedOperatorHandle<RotSig>& rot_apply_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::rotary_qk_apply", "").typed<RotSig>();
  return op;
}

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& k, const Tensor& cos, const Tensor& sin) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [qo, ko] = rot_apply_op().call(q, k, cos, sin, false);
    ctx->save_for_backward({cos, sin});  // the rotation is linear: nothing else is kept
    ctx->saved_data["q_sizes"] = q.sizes().vec();
    ctx->saved_data["k_sizes"] = k.sizes().vec();
    return {qo, ko};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    Tensor dq = grads[0], dk = grads[1];
    if (!dq.defined() && !dk.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    // An output without a gradient contributes zeros (the kernel takes both in one launch).
    const auto opts = (dq.defined() ? dq : dk).options();
    if (!dq.defined()) dq = at::zeros(ctx->saved_data["q_sizes"].toIntVector(), opts);
    if (!dk.defined()) dk = at::zeros(ctx->saved_data["k_sizes"].toIntVector(), opts);
    auto [gq, gk] = rot_apply_op().call(dq.contiguous(), dk.contiguous(), saved[0], saved[1], true);
    return {gq, gk, Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> rot_autograd(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  auto out = RotaryFunction::apply(q, k, cos, sin);
  return {out[0], out[1]};
}
std::tuple<Tensor, Tensor> rot_nograd(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  return rot_apply_op().call(q, k, cos, sin, false);
}

}  // namespace

std::tuple<Tensor, Tensor> rotary_qk(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::rotary_qk", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>();
  return op.call(q, k, cos, sin);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) { m.impl("rotary_qk", &strobe::ops::rot_autograd); }
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("rotary_qk", &strobe::ops::rot_nograd);
  m.impl("rotary_qk_apply", &strobe::ops::rot_apply_cpu);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) { m.impl("rotary_qk", &strobe::ops::rot_nograd); }
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("rotary_qk", &strobe::ops::rot_nograd);
  m.impl("rotary_qk_apply", &strobe::ops::rot_apply_meta);
}
