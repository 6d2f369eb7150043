// batch_norm_act: training-mode BatchNorm2d (+ residual) (+ ReLU) in one op (docs/OPS.md).
// Argument checks, the CPU implementation (ATen ops in fp32, fp64 for fp64 inputs; it is also the
// reference of the CUDA kernels' tests), the Meta kernels, autograd and the C++ wrapper. CUDA
// kernels: cuda/batch_norm_act_kernels.cu, glue: batch_norm_act_cuda.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/ops.h"

namespace strobe::ops {
namespace detail {

// Used by the CUDA glue too.
void batch_norm_act_check(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                          const at::Tensor& running_mean, const at::Tensor& running_var,
                          const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.defined() && weight.defined() && bias.defined() && running_mean.defined() && running_var.defined(),
              "batch_norm_act: x, weight, bias, running_mean and running_var must be defined");
  TORCH_CHECK(x.dim() == 4, "batch_norm_act: x must be [N, C, H, W], got ", x.sym_sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "batch_norm_act: x must be floating point, got ", x.scalar_type());
  const auto c = x.sym_size(1);
  for (const auto* t : {&weight, &bias, &running_mean, &running_var}) {
    TORCH_CHECK(t->dim() == 1 && t->sym_size(0) == c && at::isFloatingType(t->scalar_type()),
                "batch_norm_act: weight, bias and the running statistics must be floating [", c, "], got ",
                t->scalar_type(), " ", t->sym_sizes());
    TORCH_CHECK(t->device() == x.device(), "batch_norm_act: all tensors must be on one device");
  }
  if (residual && residual->defined()) {
    TORCH_CHECK(residual->sym_sizes() == x.sym_sizes() && residual->scalar_type() == x.scalar_type() &&
                    residual->device() == x.device(),
                "batch_norm_act: residual must match x (", x.sym_sizes(), " ", x.scalar_type(), "), got ",
                residual->sym_sizes(), " ", residual->scalar_type());
  }
  TORCH_CHECK(x.sym_numel() == 0 || x.sym_numel() / c > 1,
              "batch_norm_act: expected more than 1 value per channel when training, got input size ", x.sym_sizes());
}

}  // namespace detail

namespace {

using at::Tensor;

at::ScalarType bna_compute_dtype(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

Tensor per_channel(const Tensor& v) { return v.view({1, -1, 1, 1}); }

std::tuple<Tensor, Tensor, Tensor> bna_fwd_cpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                           Tensor& running_mean, Tensor& running_var,
                                           const std::optional<Tensor>& residual, double momentum, double eps,
                                           bool relu) {
  detail::batch_norm_act_check(x, weight, bias, running_mean, running_var, residual);
  const auto cd = bna_compute_dtype(x);
  const Tensor xf = x.to(cd);
  const double n = static_cast<double>(x.numel() / x.size(1));
  const Tensor mean = xf.mean({0, 2, 3});
  const Tensor var = (xf - per_channel(mean)).square().mean({0, 2, 3});
  const Tensor invstd = (var + eps).rsqrt();
  {
    at::NoGradGuard no_grad;
    running_mean.mul_(1.0 - momentum).add_(mean.to(running_mean.scalar_type()), momentum);
    running_var.mul_(1.0 - momentum).add_((var * (n / (n - 1.0))).to(running_var.scalar_type()), momentum);
  }
  Tensor z = (xf - per_channel(mean)) * per_channel(weight.to(cd) * invstd) + per_channel(bias.to(cd));
  if (residual && residual->defined()) z = z + residual->to(cd);
  if (relu) z = at::relu(z);
  // mean/invstd in the compute dtype (fp64 for fp64 x: the reference keeps its precision)
  return {z.to(x.scalar_type()).contiguous(x.suggest_memory_format()), mean, invstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> bna_bwd_cpu(const Tensor& grad_y, const Tensor& y, const Tensor& x,
                                                   const Tensor& weight, const Tensor& mean, const Tensor& invstd,
                                                   bool relu, bool residual_grad) {
  const auto cd = bna_compute_dtype(x);
  const double n = static_cast<double>(x.numel() / x.size(1));
  Tensor g = grad_y.to(cd);
  if (relu) g = g * (y > 0).to(cd);
  const Tensor xhat = (x.to(cd) - per_channel(mean.to(cd))) * per_channel(invstd.to(cd));
  const Tensor gb = g.sum({0, 2, 3}), gw = (g * xhat).sum({0, 2, 3});
  const Tensor gx = per_channel(weight.to(cd) * invstd.to(cd)) * (g - per_channel(gb / n) - xhat * per_channel(gw / n));
  const auto fmt = x.suggest_memory_format();
  return {gx.to(x.scalar_type()).contiguous(fmt), gw.to(weight.scalar_type()), gb.to(weight.scalar_type()),
          residual_grad ? g.to(x.scalar_type()).contiguous(fmt) : Tensor()};
}

std::tuple<Tensor, Tensor, Tensor> bna_fwd_meta(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                            Tensor& running_mean, Tensor& running_var,
                                            const std::optional<Tensor>& residual, double, double, bool) {
  detail::batch_norm_act_check(x, weight, bias, running_mean, running_var, residual);
  const auto fopt = x.options().dtype(bna_compute_dtype(x));
  return {at::empty_like(x), at::empty_symint({x.sym_size(1)}, fopt), at::empty_symint({x.sym_size(1)}, fopt)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> bna_bwd_meta(const Tensor&, const Tensor&, const Tensor& x,
                                                    const Tensor& weight, const Tensor&, const Tensor&, bool,
                                                    bool residual_grad) {
  return {at::empty_like(x), at::empty_like(weight), at::empty_like(weight),
          residual_grad ? at::empty_like(x) : Tensor()};
}

using BnaFwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                                                  const std::optional<Tensor>&, double, double, bool);
using BnaBwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                          const Tensor&, const Tensor&, const Tensor&, bool, bool);

const c10::TypedOperatorHandle<BnaFwdSig>& bna_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::batch_norm_act_fwd", "").typed<BnaFwdSig>();
  return op;
}
const c10::TypedOperatorHandle<BnaBwdSig>& bna_bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::batch_norm_act_bwd", "").typed<BnaBwdSig>();
  return op;
}

class BatchNormActFunction : public torch::autograd::Function<BatchNormActFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const Tensor& bias, Tensor running_mean, Tensor running_var,
                        const std::optional<Tensor>& residual, double momentum, double eps, bool relu) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, mean, invstd] = bna_fwd_op().call(x, weight, bias, running_mean, running_var, residual, momentum, eps, relu);
    ctx->save_for_backward({y, x, weight, mean, invstd});
    ctx->saved_data["relu"] = relu;
    ctx->saved_data["residual"] = residual.has_value() && residual->defined();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const Tensor& go = grad_outputs[0];
    const bool has_res = ctx->saved_data["residual"].toBool();
    if (!go.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const auto s = ctx->get_saved_variables();
    auto [gx, gw, gb, gres] = bna_bwd_op().call(go, s[0], s[1], s[2], s[3], s[4], ctx->saved_data["relu"].toBool(), has_res);
    return {gx, gw, gb, Tensor(), Tensor(), has_res ? gres : Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor batch_norm_act_autograd(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& running_mean,
                               Tensor& running_var, const std::optional<Tensor>& residual, double momentum,
                               double eps, bool relu) {
  return BatchNormActFunction::apply(x, weight, bias, running_mean, running_var, residual, momentum, eps, relu);
}

Tensor batch_norm_act_nograd(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& running_mean,
                             Tensor& running_var, const std::optional<Tensor>& residual, double momentum, double eps,
                             bool relu) {
  return std::get<0>(bna_fwd_op().call(x, weight, bias, running_mean, running_var, residual, momentum, eps, relu));
}

}  // namespace

Tensor batch_norm_act(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& running_mean,
                      Tensor& running_var, const std::optional<Tensor>& residual, double momentum, double eps,
                      bool relu) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::batch_norm_act", "")
                             .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                                           const std::optional<Tensor>&, double, double, bool)>();
  return op.call(x, weight, bias, running_mean, running_var, residual, momentum, eps, relu);
}

bool batch_norm_act_cuda_eligible(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                  const Tensor& running_mean, const Tensor& running_var) {
  if (!built_with_cuda() || !x.is_cuda() || x.dim() != 4 || x.size(1) % 8 != 0) return false;
  if (!x.is_contiguous(at::MemoryFormat::ChannelsLast)) return false;
  const auto dt = x.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) return false;
  for (const auto* t : {&weight, &bias, &running_mean, &running_var})
    if (!t->defined() || t->scalar_type() != at::kFloat) return false;
  return true;
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) { m.impl("batch_norm_act", &strobe::ops::batch_norm_act_autograd); }
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("batch_norm_act", &strobe::ops::batch_norm_act_nograd);
  m.impl("batch_norm_act_fwd", &strobe::ops::bna_fwd_cpu);
  m.impl("batch_norm_act_bwd", &strobe::ops::bna_bwd_cpu);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) { m.impl("batch_norm_act", &strobe::ops::batch_norm_act_nograd); }
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("batch_norm_act", &strobe::ops::batch_norm_act_nograd);
  m.impl("batch_norm_act_fwd", &strobe::ops::bna_fwd_meta);
  m.impl("batch_norm_act_bwd", &strobe::ops::bna_bwd_meta);
}
