// add_layer_norm / layer_norm: sum = x + delta, y = LayerNorm(sum) * weight (+ bias) over the last
// dimension, forward and backward fused (docs/OPS.md). Argument checks shared by every device, the
// CPU implementation (ATen ops in fp32, fp64 for fp64 inputs: the reference), the Meta kernels,
// autograd and the C++ wrappers. CUDA kernels: cuda/fused_norm_kernels.cu, glue:
// add_layer_norm_cuda.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/ops.h"
#include "strobe/ops/internal.h"

namespace strobe::ops {
namespace detail {

// Used by the CUDA glue too.
void add_layer_norm_check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                                 const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.defined() && weight.defined(), "add_layer_norm: x and weight must be defined");
  TORCH_CHECK(x.dim() >= 1, "add_layer_norm: x must have at least one dimension");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "add_layer_norm: x must be floating point, got ",
              x.scalar_type());
  const c10::SymInt& c = x.sym_size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.sym_size(0) == c, "add_layer_norm: weight must be [", c,
              "], got ", weight.sym_sizes());
  TORCH_CHECK(at::isFloatingType(weight.scalar_type()), "add_layer_norm: weight must be floating");
  TORCH_CHECK(weight.device() == x.device(), "add_layer_norm: weight is on ", weight.device(),
              ", x on ", x.device());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == c && bias->scalar_type() == weight.scalar_type() &&
                    bias->device() == x.device(),
                "add_layer_norm: bias must be [", c, "] of weight's dtype on x's device, got ",
                bias->sym_sizes(), " ", bias->scalar_type());
  }
  if (delta.has_value() && delta->defined()) {
    TORCH_CHECK(delta->sym_sizes() == x.sym_sizes() && delta->scalar_type() == x.scalar_type() &&
                    delta->device() == x.device(),
                "add_layer_norm: delta must have x's shape ", x.sym_sizes(), ", dtype ", x.scalar_type(),
                " and device; got ", delta->sym_sizes(), " ", delta->scalar_type(), " on ", delta->device());
  }
}

}  // namespace detail

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

using detail::present;

at::ScalarType aln_compute_dtype(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// (y, mean, rstd, sum): sum is x + delta in x's dtype (undefined without delta); mean and rstd
// are x.shape[:-1], fp32 (fp64 for fp64 x).
std::tuple<Tensor, Tensor, Tensor, Tensor> aln_fwd_cpu(const Tensor& x, const OptTensor& delta,
                                                   const Tensor& weight, const OptTensor& bias, double eps) {
  detail::add_layer_norm_check_inputs(x, delta, weight, bias);
  // The sum is rounded to x's dtype first, as the CUDA kernel: LayerNorm sees the stored stream.
  const Tensor s = present(delta) ? at::add(x, *delta) : x;
  const auto cd = aln_compute_dtype(x);
  const Tensor sf = s.to(cd);
  const Tensor mean = sf.mean(-1, true);
  const Tensor xc = sf - mean;
  const Tensor rstd = at::rsqrt((xc * xc).mean(-1, true) + eps);
  Tensor y = xc * rstd * weight.to(cd);
  if (present(bias)) y = y + bias->to(cd);
  return {y.to(x.scalar_type()), mean.squeeze(-1), rstd.squeeze(-1), present(delta) ? s : Tensor()};
}

// (dx, dweight, dbias): dx = dsum + d LN / d input (input's dtype); dweight / dbias in weight's
// dtype (dbias undefined unless has_bias).
std::tuple<Tensor, Tensor, Tensor> aln_bwd_cpu(const Tensor& dy, const OptTensor& dsum, const Tensor& input,
                                           const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                                           bool has_bias) {
  TORCH_CHECK(dy.sizes() == input.sizes(), "add_layer_norm_bwd: dy must be ", input.sizes());
  TORCH_CHECK(!present(dsum) || dsum->sizes() == input.sizes(), "add_layer_norm_bwd: dsum must be ",
              input.sizes());
  const auto cd = aln_compute_dtype(input);
  const int64_t c = input.size(-1);
  const Tensor r = rstd.to(cd).unsqueeze(-1);
  const Tensor xh = (input.to(cd) - mean.to(cd).unsqueeze(-1)) * r;
  const Tensor dyf = dy.to(cd);
  const Tensor g = dyf * weight.to(cd);
  Tensor dx = (g - g.mean(-1, true) - xh * (g * xh).mean(-1, true)) * r;
  if (present(dsum)) dx = dx + dsum->to(cd);
  const Tensor dw = (dyf * xh).reshape({-1, c}).sum(0).to(weight.scalar_type());
  const Tensor db = has_bias ? dyf.reshape({-1, c}).sum(0).to(weight.scalar_type()) : Tensor();
  return {dx.to(input.scalar_type()), dw, db};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> aln_fwd_meta(const Tensor& x, const OptTensor& delta,
                                                    const Tensor& weight, const OptTensor& bias, double eps) {
  (void)eps;
  detail::add_layer_norm_check_inputs(x, delta, weight, bias);
  const auto stat = x.options().dtype(aln_compute_dtype(x));
  const auto rows = x.sym_sizes().slice(0, x.dim() - 1);
  return {at::empty_symint(x.sym_sizes(), x.options()), at::empty_symint(rows, stat),
          at::empty_symint(rows, stat), present(delta) ? at::empty_symint(x.sym_sizes(), x.options()) : Tensor()};
}

std::tuple<Tensor, Tensor, Tensor> aln_bwd_meta(const Tensor& dy, const OptTensor& dsum, const Tensor& input,
                                            const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                                            bool has_bias) {
  (void)dy;
  (void)dsum;
  (void)mean;
  (void)rstd;
  return {at::empty_symint(input.sym_sizes(), input.options()), at::empty_symint(weight.sym_sizes(), weight.options()),
          has_bias ? at::empty_symint(weight.sym_sizes(), weight.options()) : Tensor()};
}

using AlnFwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&,
                                                          const OptTensor&, double);
using AlnFwdAmaxSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&,
                                                                      const OptTensor&, double);

// add_layer_norm_fwd_amax on the CPU and Meta: the forward, then max |y| (fp8_amax).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> aln_fwd_amax_cpu(const Tensor& x, const OptTensor& delta,
                                                                    const Tensor& weight, const OptTensor& bias,
                                                                    double eps) {
  auto [y, mean, rstd, sum] = aln_fwd_cpu(x, delta, weight, bias, eps);
  return {y, mean, rstd, sum, detail::fp8_amax(y)};
}
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> aln_fwd_amax_meta(const Tensor& x, const OptTensor& delta,
                                                                     const Tensor& weight, const OptTensor& bias,
                                                                     double eps) {
  auto [y, mean, rstd, sum] = aln_fwd_meta(x, delta, weight, bias, eps);
  return {y, mean, rstd, sum, at::empty({}, x.options().dtype(at::kFloat))};
}
using AlnBwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, const Tensor&, bool);

const c10::TypedOperatorHandle<AlnFwdSig>& aln_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::add_layer_norm_fwd", "").typed<AlnFwdSig>();
  return op;
}
const c10::TypedOperatorHandle<AlnFwdAmaxSig>& aln_fwd_amax_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::add_layer_norm_fwd_amax", "").typed<AlnFwdAmaxSig>();
  return op;
}
const c10::TypedOperatorHandle<AlnBwdSig>& aln_bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::add_layer_norm_bwd", "").typed<AlnBwdSig>();
  return op;
}

// One Function for the public ops: with delta it returns (sum, y), without it (y); with `amax`
// (add_layer_norm_amax) also y_amax, not differentiable.
class AddLayerNormFunction : public torch::autograd::Function<AddLayerNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const OptTensor& delta, const Tensor& weight,
                                                const OptTensor& bias, double eps, bool amax) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor y, mean, rstd, sum, y_amax;
    if (amax) std::tie(y, mean, rstd, sum, y_amax) = aln_fwd_amax_op().call(x, delta, weight, bias, eps);
    else std::tie(y, mean, rstd, sum) = aln_fwd_op().call(x, delta, weight, bias, eps);
    const bool has_delta = present(delta);
    ctx->save_for_backward({has_delta ? sum : x, mean, rstd, weight});
    ctx->saved_data["has_delta"] = has_delta;
    ctx->saved_data["has_bias"] = present(bias);
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
    auto [dx, dw, db] = aln_bwd_op().call(gy.contiguous(), ds, input, saved[1], saved[2], saved[3],
                                      ctx->saved_data["has_bias"].toBool());
    return {dx, has_delta ? dx : Tensor(), dw, db, Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> add_ln_autograd(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                           const OptTensor& bias, double eps) {
  auto out = AddLayerNormFunction::apply(x, OptTensor(delta), weight, bias, eps, false);
  return {out[0], out[1]};
}
std::tuple<Tensor, Tensor, Tensor> add_ln_amax_autograd(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                                        const OptTensor& bias, double eps) {
  auto out = AddLayerNormFunction::apply(x, OptTensor(delta), weight, bias, eps, true);
  return {out[0], out[1], out[2]};
}
std::tuple<Tensor, Tensor, Tensor> add_ln_amax_nograd(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                                      const OptTensor& bias, double eps) {
  auto [y, mean, rstd, sum, y_amax] = aln_fwd_amax_op().call(x, OptTensor(delta), weight, bias, eps);
  return {sum, y, y_amax};
}
std::tuple<Tensor, Tensor> add_ln_nograd(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                         const OptTensor& bias, double eps) {
  auto [y, mean, rstd, sum] = aln_fwd_op().call(x, OptTensor(delta), weight, bias, eps);
  return {sum, y};
}
Tensor ln_autograd(const Tensor& x, const Tensor& weight, const OptTensor& bias, double eps) {
  return AddLayerNormFunction::apply(x, std::nullopt, weight, bias, eps, false)[0];
}
Tensor ln_nograd(const Tensor& x, const Tensor& weight, const OptTensor& bias, double eps) {
  return std::get<0>(aln_fwd_op().call(x, std::nullopt, weight, bias, eps));
}

}  // namespace

std::tuple<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                          const std::optional<Tensor>& bias, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::add_layer_norm", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                               const OptTensor&, double)>();
  return op.call(x, delta, weight, bias, eps);
}

std::tuple<Tensor, Tensor, Tensor> add_layer_norm_amax(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                                       const std::optional<Tensor>& bias, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::add_layer_norm_amax", "")
                             .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                       const OptTensor&, double)>();
  return op.call(x, delta, weight, bias, eps);
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, double eps) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::layer_norm", "")
          .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&, double)>();
  return op.call(x, weight, bias, eps);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) {
  m.impl("add_layer_norm", &strobe::ops::add_ln_autograd);
  m.impl("add_layer_norm_amax", &strobe::ops::add_ln_amax_autograd);
  m.impl("layer_norm", &strobe::ops::ln_autograd);
}
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("add_layer_norm", &strobe::ops::add_ln_nograd);
  m.impl("layer_norm", &strobe::ops::ln_nograd);
  m.impl("add_layer_norm_fwd", &strobe::ops::aln_fwd_cpu);
  m.impl("add_layer_norm_fwd_amax", &strobe::ops::aln_fwd_amax_cpu);
  m.impl("add_layer_norm_amax", &strobe::ops::add_ln_amax_nograd);
  m.impl("add_layer_norm_bwd", &strobe::ops::aln_bwd_cpu);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("add_layer_norm", &strobe::ops::add_ln_nograd);
  m.impl("add_layer_norm_amax", &strobe::ops::add_ln_amax_nograd);
  m.impl("layer_norm", &strobe::ops::ln_nograd);
}
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("add_layer_norm", &strobe::ops::add_ln_nograd);
  m.impl("layer_norm", &strobe::ops::ln_nograd);
  m.impl("add_layer_norm_fwd", &strobe::ops::aln_fwd_meta);
  m.impl("add_layer_norm_fwd_amax", &strobe::ops::aln_fwd_amax_meta);
  m.impl("add_layer_norm_amax", &strobe::ops::add_ln_amax_nograd);
  m.impl("add_layer_norm_bwd", &strobe::ops::aln_bwd_meta);
}
