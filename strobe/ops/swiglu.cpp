// swiglu: silu(gate) * up over one [..., 2 x F] projection output (gate first, up second), forward and
// backward fused (docs/OPS.md). Argument checks shared by every device, the CPU implementation (ATen:
// transformers' `act_fn(gate) * up` and autograd's backward of it, op for op: the reference), the
// Meta kernels, autograd and the C++ wrapper; the halves that also return their output's amax (for
// fp8_linear_swiglu). CUDA kernels: cuda/swiglu_kernels.cu, glue swiglu_cuda.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/internal.h"
#include "strobe/ops/ops.h"

namespace strobe::ops {
namespace detail {

// Used by the CUDA glue too.
void swiglu_check_input(const at::Tensor& gu) {
  TORCH_CHECK(gu.defined() && gu.dim() >= 1, "swiglu: gate_up must have at least one dimension");
  TORCH_CHECK(at::isFloatingType(gu.scalar_type()), "swiglu: gate_up must be floating point, got ", gu.scalar_type());
  TORCH_CHECK(gu.sym_size(-1) % 2 == 0, "swiglu: the last dimension of gate_up holds gate and up (2 x F), got ",
              gu.sym_size(-1));
}

}  // namespace detail

namespace {

using at::Tensor;

Tensor swiglu_out_shape_like(const Tensor& gu) {
  auto sizes = gu.sym_sizes().vec();
  sizes.back() = sizes.back() / 2;
  return at::empty_symint(sizes, gu.options());
}

// gate and up as contiguous tensors, as transformers' two projections return them (ATen's CPU silu
// takes another code path, with other roundings, on a strided view).
std::pair<Tensor, Tensor> sw_parts(const Tensor& gu) {
  const auto parts = gu.chunk(2, -1);
  return {parts[0].contiguous(), parts[1].contiguous()};
}

Tensor sw_fwd_cpu(const Tensor& gu) {
  detail::swiglu_check_input(gu);
  const auto [gate, up] = sw_parts(gu);
  return at::silu(gate) * up;
}

// d gate_up = [silu_backward(dy * up, gate), dy * silu(gate)], as autograd computes it.
Tensor sw_bwd_cpu(const Tensor& dy, const Tensor& gu) {
  detail::swiglu_check_input(gu);
  const auto [gate, up] = sw_parts(gu);
  TORCH_CHECK(dy.sizes() == gate.sizes(), "swiglu_bwd: dy must be ", gate.sizes(), ", got ", dy.sizes());
  const Tensor ds = dy * up;
  const Tensor du = dy * at::silu(gate);
  return at::cat({at::silu_backward(ds, gate), du}, -1);
}

std::tuple<Tensor, Tensor> sw_fwd_amax_cpu(const Tensor& gu) {
  Tensor y = sw_fwd_cpu(gu);
  Tensor amax = detail::fp8_amax(y);
  return {y, amax};
}
std::tuple<Tensor, Tensor> sw_bwd_amax_cpu(const Tensor& dy, const Tensor& gu) {
  Tensor dgu = sw_bwd_cpu(dy, gu);
  Tensor amax = detail::fp8_amax(dgu);
  return {dgu, amax};
}
std::tuple<Tensor, Tensor> sw_fwd_amax_meta(const Tensor& gu) {
  detail::swiglu_check_input(gu);
  return {swiglu_out_shape_like(gu), at::empty({}, gu.options().dtype(at::kFloat))};
}
std::tuple<Tensor, Tensor> sw_bwd_amax_meta(const Tensor& dy, const Tensor& gu) {
  (void)dy;
  return {at::empty_symint(gu.sym_sizes(), gu.options()), at::empty({}, gu.options().dtype(at::kFloat))};
}

Tensor sw_fwd_meta(const Tensor& gu) {
  detail::swiglu_check_input(gu);
  return swiglu_out_shape_like(gu);
}
Tensor sw_bwd_meta(const Tensor& dy, const Tensor& gu) {
  (void)dy;
  return at::empty_symint(gu.sym_sizes(), gu.options());
}

const c10::TypedOperatorHandle<Tensor(const Tensor&)>& sw_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::swiglu_fwd", "").typed<Tensor(const Tensor&)>();
  return op;
}
const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&)>& sw_bwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::swiglu_bwd", "")
                             .typed<Tensor(const Tensor&, const Tensor&)>();
  return op;
}

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& gu) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({gu});  // silu(gate) is recomputed in the backward, not kept
    return sw_fwd_op().call(gu);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {sw_bwd_op().call(grads[0].contiguous(), ctx->get_saved_variables()[0])};
  }
};

Tensor sw_autograd(const Tensor& gu) { return SwigluFunction::apply(gu); }
Tensor sw_nograd(const Tensor& gu) { return sw_fwd_op().call(gu); }

}  // namespace

Tensor swiglu(const Tensor& gate_up) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::swiglu", "").typed<Tensor(const Tensor&)>();
  return op.call(gate_up);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) { m.impl("swiglu", &strobe::ops::sw_autograd); }
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("swiglu", &strobe::ops::sw_nograd);
  m.impl("swiglu_fwd", &strobe::ops::sw_fwd_cpu);
  m.impl("swiglu_bwd", &strobe::ops::sw_bwd_cpu);
  m.impl("swiglu_fwd_amax", &strobe::ops::sw_fwd_amax_cpu);
  m.impl("swiglu_bwd_amax", &strobe::ops::sw_bwd_amax_cpu);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) { m.impl("swiglu", &strobe::ops::sw_nograd); }
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("swiglu", &strobe::ops::sw_nograd);
  m.impl("swiglu_fwd", &strobe::ops::sw_fwd_meta);
  m.impl("swiglu_bwd", &strobe::ops::sw_bwd_meta);
  m.impl("swiglu_fwd_amax", &strobe::ops::sw_fwd_amax_meta);
  m.impl("swiglu_bwd_amax", &strobe::ops::sw_bwd_amax_meta);
}
