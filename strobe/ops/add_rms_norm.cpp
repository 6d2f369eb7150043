// add_rms_norm / rms_norm: sum = x + delta, y = RMSNorm(sum) * weight over the last dimension, in
// Hugging Face's LlamaRMSNorm numerics (fp32 statistics; the normalised row rounded to x's dtype,
// then multiplied by the weight and rounded again), forward and backward fused (docs/OPS.md).
// Argument checks shared by every device, the CPU implementation (ATen ops in fp32, fp64 for fp64
// inputs: the reference), the Meta kernels, autograd and the C++ wrappers. CUDA: the RMS mode of
// cuda/fused_norm_kernels.cu, glue in add_layer_norm_cuda.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/ops.h"
#include "strobe/ops/internal.h"

namespace strobe::ops {
namespace detail {

// Used by the CUDA glue too.
void add_rms_norm_check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight) {
  TORCH_CHECK(x.defined() && weight.defined(), "add_rms_norm: x and weight must be defined");
  TORCH_CHECK(x.dim() >= 1, "add_rms_norm: x must have at least one dimension");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "add_rms_norm: x must be floating point, got ", x.scalar_type());
  const c10::SymInt& c = x.sym_size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.sym_size(0) == c, "add_rms_norm: weight must be [", c, "], got ",
              weight.sym_sizes());
  TORCH_CHECK(at::isFloatingType(weight.scalar_type()), "add_rms_norm: weight must be floating");
  // y has x's dtype: Hugging Face's `weight * normed` is computed in the promoted dtype, so a weight
  // that would promote x (fp32 weights on a bf16 stream) is refused rather than silently rounded.
  TORCH_CHECK(at::promote_types(x.scalar_type(), weight.scalar_type()) == x.scalar_type(),
              "add_rms_norm: a ", weight.scalar_type(), " weight would promote the ", x.scalar_type(),
              " activations (y keeps x's dtype); cast one of them");
  TORCH_CHECK(weight.device() == x.device(), "add_rms_norm: weight is on ", weight.device(), ", x on ", x.device());
  if (delta.has_value() && delta->defined()) {
    TORCH_CHECK(delta->sym_sizes() == x.sym_sizes() && delta->scalar_type() == x.scalar_type() &&
                    delta->device() == x.device(),
                "add_rms_norm: delta must have x's shape ", x.sym_sizes(), ", dtype ", x.scalar_type(),
                " and device; got ", delta->sym_sizes(), " ", delta->scalar_type(), " on ", delta->device());
  }
}

}  // namespace detail

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

using detail::present;

at::ScalarType arn_compute_dtype(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// (y, rstd, sum): sum = x + delta in x's dtype (undefined without delta); rstd x.shape[:-1], fp32
// (fp64 for fp64 x).
std::tuple<Tensor, Tensor, Tensor> arn_fwd_cpu(const Tensor& x, const OptTensor& delta, const Tensor& weight,
                                               double eps) {
  detail::add_rms_norm_check_inputs(x, delta, weight);
  const Tensor s = present(delta) ? at::add(x, *delta) : x;
  const auto cd = arn_compute_dtype(x);
  const Tensor sf = s.to(cd);
  const Tensor rstd = at::rsqrt(sf.pow(2).mean(-1, true) + eps);
  const Tensor normed = (sf * rstd).to(x.scalar_type());
  const Tensor y = (normed.to(cd) * weight.to(cd)).to(x.scalar_type());
  return {y, rstd.squeeze(-1), present(delta) ? s : Tensor()};
}

// (dx, dweight): dx = dsum + d RMSNorm / d input (input's dtype); dweight in weight's dtype.
std::tuple<Tensor, Tensor> arn_bwd_cpu(const Tensor& dy, const OptTensor& dsum, const Tensor& input,
                                       const Tensor& rstd, const Tensor& weight) {
  TORCH_CHECK(dy.sizes() == input.sizes(), "add_rms_norm_bwd: dy must be ", input.sizes());
  TORCH_CHECK(!present(dsum) || dsum->sizes() == input.sizes(), "add_rms_norm_bwd: dsum must be ", input.sizes());
  const auto cd = arn_compute_dtype(input);
  const int64_t c = input.size(-1);
  const Tensor r = rstd.to(cd).unsqueeze(-1);
  const Tensor xh = input.to(cd) * r;
  const Tensor dyf = dy.to(cd);
  const Tensor g = dyf * weight.to(cd);
  Tensor dx = (g - xh * (g * xh).mean(-1, true)) * r;
  if (present(dsum)) dx = dx + dsum->to(cd);
  // The forward multiplied the weight by the normalised row rounded to the input's dtype.
  const Tensor dw = (dyf * xh.to(input.scalar_type()).to(cd)).reshape({-1, c}).sum(0).to(weight.scalar_type());
  return {dx.to(input.scalar_type()), dw};
}

std::tuple<Tensor, Tensor, Tensor> arn_fwd_meta(const Tensor& x, const OptTensor& delta, const Tensor& weight,
                                                double eps) {
  (void)eps;
  detail::add_rms_norm_check_inputs(x, delta, weight);
  const auto rows = x.sym_sizes().slice(0, x.dim() - 1);
  return {at::empty_symint(x.sym_sizes(), x.options()),
          at::empty_symint(rows, x.options().dtype(arn_compute_dtype(x))),
          present(delta) ? at::empty_symint(x.sym_sizes(), x.options()) : Tensor()};
}

std::tuple<Tensor, Tensor> arn_bwd_meta(const Tensor& dy, const OptTensor& dsum, const Tensor& input,
                                        const Tensor& rstd, const Tensor& weight) {
  (void)dy;
  (void)dsum;
  (void)rstd;
  return {at::empty_symint(input.sym_sizes(), input.options()), at::empty_symint(weight.sym_sizes(), weight.options())};
}

using ArnFwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&, double);
using ArnFwdAmaxSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&, double);

// add_rms_norm_fwd_amax on the CPU and Meta: the forward, then max |y| (fp8_amax).
std::tuple<Tensor, Tensor, Tensor, Tensor> arn_fwd_amax_cpu(const Tensor& x, const OptTensor& delta, const Tensor& weight,
                                                            double eps) {
  auto [y, rstd, sum] = arn_fwd_cpu(x, delta, weight, eps);
  return {y, rstd, sum, detail::fp8_amax(y)};
}
std::tuple<Tensor, Tensor, Tensor, Tensor> arn_fwd_amax_meta(const Tensor& x, const OptTensor& delta,
                                                             const Tensor& weight, double eps) {
  auto [y, rstd, sum] = arn_fwd_meta(x, delta, weight, eps);
  return {y, rstd, sum, at::empty({}, x.options().dtype(at::kFloat))};
}

using ArnBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                                             const Tensor&);

const c10::TypedOperatorHandle<ArnFwdSig>& arn_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::add_rms_norm_fwd", "").typed<ArnFwdSig>();
  return op;
}
const c10::TypedOperatorHandle<ArnFwdAmaxSig>& arn_fwd_amax_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::add_rms_norm_fwd_amax", "").typed<ArnFwdAmaxSig>();
  return op;
}
const c10::TypedOperatorHandle<ArnBwdSig>& arn_bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::add_rms_norm_bwd", "").typed<ArnBwdSig>();
  return op;
}

// One Function for the public ops: with delta it returns (sum, y), without it (y); with `amax`
// (add_rms_norm_amax) also y_amax, not differentiable.
class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const OptTensor& delta, const Tensor& weight, double eps, bool amax) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor y, rstd, sum, y_amax;
    if (amax) std::tie(y, rstd, sum, y_amax) = arn_fwd_amax_op().call(x, delta, weight, eps);
    else std::tie(y, rstd, sum) = arn_fwd_op().call(x, delta, weight, eps);
    const bool has_delta = present(delta);
    ctx->save_for_backward({has_delta ? sum : x, rstd, weight});
    ctx->saved_data["has_delta"] = has_delta;
    if (amax) {
      ctx->mark_non_differentiable({y_amax});
      return {sum, y, y_amax};
    }
    if (has_delta) return {sum, y};
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const bool has_delta = ctx->saved_data["has_delta"].toBool();
    const auto saved = ctx->get_saved_variables();
    const Tensor& input = saved[0];
    Tensor gsum = has_delta ? grads[0] : Tensor();
    Tensor gy = has_delta ? grads[1] : grads[0];
    if (!gy.defined()) gy = at::zeros_like(input);
    const OptTensor ds = gsum.defined() ? OptTensor(gsum.contiguous()) : std::nullopt;
    auto [dx, dw] = arn_bwd_op().call(gy.contiguous(), ds, input, saved[1], saved[2]);
    return {dx, has_delta ? dx : Tensor(), dw, Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> add_rms_autograd(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  auto out = AddRmsNormFunction::apply(x, OptTensor(delta), weight, eps, false);
  return {out[0], out[1]};
}
std::tuple<Tensor, Tensor, Tensor> add_rms_amax_autograd(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                                         double eps) {
  auto out = AddRmsNormFunction::apply(x, OptTensor(delta), weight, eps, true);
  return {out[0], out[1], out[2]};
}
std::tuple<Tensor, Tensor, Tensor> add_rms_amax_nograd(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                                       double eps) {
  auto [y, rstd, sum, y_amax] = arn_fwd_amax_op().call(x, OptTensor(delta), weight, eps);
  return {sum, y, y_amax};
}
std::tuple<Tensor, Tensor> add_rms_nograd(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  auto [y, rstd, sum] = arn_fwd_op().call(x, OptTensor(delta), weight, eps);
  return {sum, y};
}
Tensor rms_autograd(const Tensor& x, const Tensor& weight, double eps) {
  return AddRmsNormFunction::apply(x, std::nullopt, weight, eps, false)[0];
}
Tensor rms_nograd(const Tensor& x, const Tensor& weight, double eps) {
  return std::get<0>(arn_fwd_op().call(x, std::nullopt, weight, eps));
}

}  // namespace

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::add_rms_norm", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>();
  return op.call(x, delta, weight, eps);
}

std::tuple<Tensor, Tensor, Tensor> add_rms_norm_amax(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                                     double eps) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::add_rms_norm_amax", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>();
  return op.call(x, delta, weight, eps);
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::rms_norm", "")
                             .typed<Tensor(const Tensor&, const Tensor&, double)>();
  return op.call(x, weight, eps);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) {
  m.impl("add_rms_norm", &strobe::ops::add_rms_autograd);
  m.impl("add_rms_norm_amax", &strobe::ops::add_rms_amax_autograd);
  m.impl("rms_norm", &strobe::ops::rms_autograd);
}
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("add_rms_norm", &strobe::ops::add_rms_nograd);
  m.impl("rms_norm", &strobe::ops::rms_nograd);
  m.impl("add_rms_norm_fwd", &strobe::ops::arn_fwd_cpu);
  m.impl("add_rms_norm_fwd_amax", &strobe::ops::arn_fwd_amax_cpu);
  m.impl("add_rms_norm_amax", &strobe::ops::add_rms_amax_nograd);
  m.impl("add_rms_norm_bwd", &strobe::ops::arn_bwd_cpu);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("add_rms_norm", &strobe::ops::add_rms_nograd);
  m.impl("add_rms_norm_amax", &strobe::ops::add_rms_amax_nograd);
  m.impl("rms_norm", &strobe::ops::rms_nograd);
}
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("add_rms_norm", &strobe::ops::add_rms_nograd);
  m.impl("rms_norm", &strobe::ops::rms_nograd);
  m.impl("add_rms_norm_fwd", &strobe::ops::arn_fwd_meta);
  m.impl("add_rms_norm_fwd_amax", &strobe::ops::arn_fwd_amax_meta);
  m.impl("add_rms_norm_amax", &strobe::ops::add_rms_amax_nograd);
  m.impl("add_rms_norm_bwd", &strobe::ops::arn_bwd_meta);
}
