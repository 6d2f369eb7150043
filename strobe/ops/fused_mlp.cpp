// fused_mlp: y = fc2(gelu_tanh(fc1(x))), the transformer MLP as one autograd function so that on CUDA
// the GELU (and fc1's bias gradient) ride in cuBLASLt GEMM epilogues (docs/OPS.md):
//   forward:  act = gelu(x w1^T + b1) with CUBLASLT_EPILOGUE_GELU_AUX_BIAS (the pre-activation is
//             written as the epilogue's aux output), then y = act w2^T + b2;
//   backward: d_pre = (dy w2) * gelu'(pre) and db1 = sum_rows d_pre in ONE GEMM
//             (CUBLASLT_EPILOGUE_DGELU_BGRAD), then dx, dw1, dw2, db2 as plain GEMMs / a sum.
// GELU is the tanh approximation (cuBLASLt's). Argument checks, the CPU implementation (ATen in fp32,
// fp64 for fp64 inputs: the reference), Meta, autograd and the C++ wrapper live here; the cuBLASLt
// glue in fused_mlp_cuda.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/ops.h"

namespace strobe::ops {
namespace detail {

void fused_mlp_check_inputs(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                            const at::Tensor& b2) {
  TORCH_CHECK(x.defined() && w1.defined() && b1.defined() && w2.defined() && b2.defined(),
              "fused_mlp: every tensor must be defined");
  TORCH_CHECK(x.dim() >= 1 && at::isFloatingType(x.scalar_type()), "fused_mlp: x must be floating [..., C]");
  TORCH_CHECK(w1.dim() == 2 && w1.sym_size(1) == x.sym_size(-1), "fused_mlp: w1 must be [H, ", x.sym_size(-1),
              "], got ", w1.sym_sizes());
  TORCH_CHECK(b1.dim() == 1 && b1.sym_size(0) == w1.sym_size(0), "fused_mlp: b1 must be [", w1.sym_size(0), "]");
  TORCH_CHECK(w2.dim() == 2 && w2.sym_size(1) == w1.sym_size(0), "fused_mlp: w2 must be [N, ", w1.sym_size(0),
              "], got ", w2.sym_sizes());
  TORCH_CHECK(b2.dim() == 1 && b2.sym_size(0) == w2.sym_size(0), "fused_mlp: b2 must be [", w2.sym_size(0), "]");
  for (const at::Tensor* t : {&w1, &b1, &w2, &b2}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->device() == x.device(),
                "fused_mlp: weights and biases must have x's dtype (", x.scalar_type(), ") and device, got ",
                t->scalar_type(), " on ", t->device());
  }
}

}  // namespace detail

namespace {

using at::Tensor;

at::ScalarType mlp_compute_dtype(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// (y, act, pre), act and pre [M, H] in x's dtype (what the backward reads).
std::tuple<Tensor, Tensor, Tensor> mlp_fwd_cpu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                                           const Tensor& b2) {
  detail::fused_mlp_check_inputs(x, w1, b1, w2, b2);
  const auto cd = mlp_compute_dtype(x);
  const Tensor x2 = x.reshape({-1, x.size(-1)}).to(cd);
  // GELU of the unrounded pre-activation, as the GEMM epilogue (which then stores both rounded).
  const Tensor pre32 = at::addmm(b1.to(cd), x2, w1.to(cd).t());
  const Tensor pre = pre32.to(x.scalar_type());
  const Tensor act = at::gelu(pre32, "tanh").to(x.scalar_type());
  Tensor y = at::addmm(b2.to(cd), act.to(cd), w2.to(cd).t()).to(x.scalar_type());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w2.size(0);
  return {y.view(shape), act, pre};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> mlp_bwd_cpu(const Tensor& dy, const Tensor& x, const Tensor& w1,
                                                           const Tensor& w2, const Tensor& act, const Tensor& pre) {
  const auto cd = mlp_compute_dtype(x);
  const Tensor x2 = x.reshape({-1, x.size(-1)}).to(cd);
  const Tensor dy2 = dy.reshape({-1, w2.size(0)}).to(cd);
  const Tensor dpre = at::gelu_backward(dy2.mm(w2.to(cd)), pre.to(cd), "tanh");
  const auto dt = x.scalar_type();
  return {dpre.mm(w1.to(cd)).to(dt).view(x.sizes()), dpre.t().mm(x2).to(dt), dpre.sum(0).to(dt),
          dy2.t().mm(act.to(cd)).to(dt), dy2.sum(0).to(dt)};
}

std::tuple<Tensor, Tensor, Tensor> mlp_fwd_meta(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                                            const Tensor& b2) {
  detail::fused_mlp_check_inputs(x, w1, b1, w2, b2);
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = w2.sym_size(0);
  const c10::SymInt rows = x.sym_numel() / x.sym_size(-1);
  return {at::empty_symint(shape, x.options()), at::empty_symint({rows, w1.sym_size(0)}, x.options()),
          at::empty_symint({rows, w1.sym_size(0)}, x.options())};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> mlp_bwd_meta(const Tensor& dy, const Tensor& x, const Tensor& w1,
                                                            const Tensor& w2, const Tensor& act, const Tensor& pre) {
  (void)dy;
  (void)act;
  (void)pre;
  return {at::empty_symint(x.sym_sizes(), x.options()), at::empty_symint(w1.sym_sizes(), w1.options()),
          at::empty_symint({w1.sym_size(0)}, w1.options()), at::empty_symint(w2.sym_sizes(), w2.options()),
          at::empty_symint({w2.sym_size(0)}, w2.options())};
}

using MlpFwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&);
using MlpBwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                  const Tensor&, const Tensor&, const Tensor&);

const c10::TypedOperatorHandle<MlpFwdSig>& mlp_fwd_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("strobe::fused_mlp_fwd", "").typed<MlpFwdSig>();
  return op;
}
const c10::TypedOperatorHandle<MlpBwdSig>& mlp_bwd_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("strobe::fused_mlp_bwd", "").typed<MlpBwdSig>();
  return op;
}

class FusedMlpFunction : public torch::autograd::Function<FusedMlpFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& w1, const Tensor& b1,
                        const Tensor& w2, const Tensor& b2) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, act, pre] = mlp_fwd_op().call(x, w1, b1, w2, b2);
    ctx->save_for_backward({x, w1, w2, act, pre});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const auto s = ctx->get_saved_variables();
    auto [dx, dw1, db1, dw2, db2] = mlp_bwd_op().call(grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4]);
    return {dx, dw1, db1, dw2, db2};
  }
};

Tensor mlp_autograd(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2) {
  return FusedMlpFunction::apply(x, w1, b1, w2, b2);
}
Tensor mlp_nograd(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2) {
  return std::get<0>(mlp_fwd_op().call(x, w1, b1, w2, b2));
}

}  // namespace

Tensor fused_mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::fused_mlp", "")
          .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>();
  return op.call(x, w1, b1, w2, b2);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) { m.impl("fused_mlp", &strobe::ops::mlp_autograd); }
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("fused_mlp", &strobe::ops::mlp_nograd);
  m.impl("fused_mlp_fwd", &strobe::ops::mlp_fwd_cpu);
  m.impl("fused_mlp_bwd", &strobe::ops::mlp_bwd_cpu);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) { m.impl("fused_mlp", &strobe::ops::mlp_nograd); }
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("fused_mlp", &strobe::ops::mlp_nograd);
  m.impl("fused_mlp_fwd", &strobe::ops::mlp_fwd_meta);
  m.impl("fused_mlp_bwd", &strobe::ops::mlp_bwd_meta);
}
