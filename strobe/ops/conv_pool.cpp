// conv3x3_maxpool_relu: y = relu(max_pool2d(conv2d(x * input_scale, weight, bias, padding=1), 2)).
// Argument checks shared by every device, the CPU implementation (ATen ops in fp32, fp64 for fp64
// inputs), the Meta kernels, autograd and the C++ wrapper. CUDA kernels: cuda/conv_pool_kernels.cu,
// glue: conv_pool_cuda.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/ops.h"

namespace strobe::ops {
namespace detail {

// Used by the CUDA glue too.
void conv_pool_check_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(x.defined() && weight.defined() && bias.defined(),
              "conv3x3_maxpool_relu: x, weight and bias must be defined");
  // sym_size throughout: torch.compile / opcheck trace with symbolic shapes.
  TORCH_CHECK(x.dim() == 4, "conv3x3_maxpool_relu: x must be [N, C, H, W], got ", x.sym_sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) || x.scalar_type() == at::kByte,
              "conv3x3_maxpool_relu: x must be floating point or uint8, got ", x.scalar_type());
  TORCH_CHECK(at::isFloatingType(weight.scalar_type()) && at::isFloatingType(bias.scalar_type()),
              "conv3x3_maxpool_relu: weight and bias must be floating point");
  TORCH_CHECK(weight.dim() == 4 && weight.sym_size(1) == x.sym_size(1) && weight.sym_size(2) == 3 &&
                  weight.sym_size(3) == 3,
              "conv3x3_maxpool_relu: weight must be [C_out, ", x.sym_size(1), ", 3, 3], got ",
              weight.sym_sizes());
  TORCH_CHECK(bias.dim() == 1 && bias.sym_size(0) == weight.sym_size(0),
              "conv3x3_maxpool_relu: bias must be [", weight.sym_size(0), "], got ", bias.sym_sizes());
  TORCH_CHECK(weight.device() == x.device() && bias.device() == x.device(),
              "conv3x3_maxpool_relu: x, weight and bias must be on one device");
}

}  // namespace detail

namespace {

using at::Tensor;

at::ScalarType cp_compute_dtype(const Tensor& x, const Tensor& w) {
  return x.scalar_type() == at::kDouble || w.scalar_type() == at::kDouble ? at::kDouble
                                                                           : at::kFloat;
}

Tensor scaled_input(const Tensor& x, double scale, at::ScalarType cd) {
  Tensor xf = x.to(cd);
  return scale == 1.0 ? xf : xf * scale;
}

void check_out_dtype(at::ScalarType out_dtype) {
  TORCH_CHECK(at::isFloatingType(out_dtype), "conv3x3_maxpool_relu: out_dtype must be floating, got ",
              out_dtype);
}

std::tuple<Tensor, Tensor> cp_fwd_cpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                   double input_scale, at::ScalarType out_dtype) {
  detail::conv_pool_check_inputs(x, weight, bias);
  check_out_dtype(out_dtype);
  const auto cd = cp_compute_dtype(x, weight);
  const Tensor z = at::conv2d(scaled_input(x, input_scale, cd), weight.to(cd), bias.to(cd), 1, 1);
  // ATen's max-pool takes the first maximum in row-major order (NaN wins), as the CUDA kernel.
  auto [m, ind] = at::max_pool2d_with_indices(z, {2, 2}, {2, 2});
  const int64_t w = x.size(3);
  const Tensor row = at::floor_divide(ind, w), col = at::remainder(ind, w);
  const Tensor argmax = at::remainder(row, 2) * 2 + at::remainder(col, 2);
  // Bit 2: the ReLU passes the gradient (!(y <= 0), threshold_backward on the result).
  const Tensor mask = (argmax + at::logical_not(m <= 0).to(at::kLong) * 4).to(at::kByte);
  return {at::relu(m).to(out_dtype), mask};
}

std::tuple<Tensor, Tensor, Tensor> cp_bwd_cpu(const Tensor& grad_y, const Tensor& x,
                                           const Tensor& weight, const Tensor& mask,
                                           double input_scale, bool input_grad) {
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.dim() == 4 && grad_y.sizes() == mask.sizes(),
              "conv3x3_maxpool_relu_bwd: mask must be uint8 shaped like grad_y ", grad_y.sizes());
  TORCH_CHECK(!input_grad || at::isFloatingType(x.scalar_type()),
              "conv3x3_maxpool_relu_bwd: no input gradient for integer x");
  const auto cd = cp_compute_dtype(x, weight);
  const int64_t n = x.size(0), h = x.size(2), w = x.size(3), cout = weight.size(0);
  const int64_t ho = mask.size(2), wo = mask.size(3);
  const Tensor m = mask.to(at::kLong);
  const Tensor gm = grad_y.to(cd) * at::bitwise_and(m, 4).ne(0).to(cd);
  const Tensor a = at::bitwise_and(m, 3);
  const Tensor rows = at::arange(ho, m.options()).view({ho, 1}) * 2 + at::floor_divide(a, 2);
  const Tensor cols = at::arange(wo, m.options()).view({1, wo}) * 2 + at::remainder(a, 2);
  const Tensor flat = (rows * w + cols).reshape({n, cout, -1});
  const Tensor gz = at::zeros({n, cout, h * w}, x.options().dtype(cd))
                        .scatter_(2, flat, gm.reshape({n, cout, -1}))
                        .view({n, cout, h, w});
  auto [gx, gw, gb] = at::convolution_backward(
      gz, scaled_input(x, input_scale, cd), weight.to(cd), std::vector<int64_t>{cout}, {1, 1},
      {1, 1}, {1, 1}, false, {0, 0}, 1, {input_grad, true, true});
  if (input_grad) gx = (input_scale == 1.0 ? gx : gx * input_scale).to(x.scalar_type());
  return {gx, gw.to(weight.scalar_type()), gb.to(weight.scalar_type())};
}

std::tuple<Tensor, Tensor> cp_fwd_meta(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                    double input_scale, at::ScalarType out_dtype) {
  (void)input_scale;
  detail::conv_pool_check_inputs(x, weight, bias);
  check_out_dtype(out_dtype);
  const std::vector<c10::SymInt> shape{x.sym_size(0), weight.sym_size(0), x.sym_size(2) / 2,
                                       x.sym_size(3) / 2};
  return {at::empty_symint(shape, x.options().dtype(out_dtype)),
          at::empty_symint(shape, x.options().dtype(at::kByte))};
}

std::tuple<Tensor, Tensor, Tensor> cp_bwd_meta(const Tensor& grad_y, const Tensor& x,
                                            const Tensor& weight, const Tensor& mask,
                                            double input_scale, bool input_grad) {
  (void)grad_y;
  (void)mask;
  (void)input_scale;
  return {input_grad ? at::empty_like(x) : Tensor(), at::empty_like(weight),
          at::empty_symint({weight.sym_size(0)}, weight.options())};
}

using CpFwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double,
                                          at::ScalarType);
using CpBwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, double, bool);

const c10::TypedOperatorHandle<CpFwdSig>& cp_fwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::conv3x3_maxpool_relu_fwd", "")
                             .typed<CpFwdSig>();
  return op;
}
const c10::TypedOperatorHandle<CpBwdSig>& cp_bwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::conv3x3_maxpool_relu_bwd", "")
                             .typed<CpBwdSig>();
  return op;
}

at::ScalarType resolve_out_dtype(const Tensor& x, std::optional<at::ScalarType> out_dtype) {
  if (out_dtype.has_value()) return *out_dtype;
  return at::isFloatingType(x.scalar_type()) ? x.scalar_type() : at::kFloat;
}

class ConvPoolFunction : public torch::autograd::Function<ConvPoolFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                        const Tensor& weight, const Tensor& bias, double input_scale,
                        std::optional<at::ScalarType> out_dtype) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, mask] = cp_fwd_op().call(x, weight, bias, input_scale, resolve_out_dtype(x, out_dtype));
    ctx->save_for_backward({x, weight, mask});
    ctx->saved_data["input_scale"] = input_scale;
    ctx->saved_data["input_grad"] = x.requires_grad();
    ctx->saved_data["bias_dtype"] = static_cast<int64_t>(bias.scalar_type());
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const Tensor& go = grad_outputs[0];
    if (!go.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const auto saved = ctx->get_saved_variables();
    auto [gx, gw, gb] = cp_bwd_op().call(go.contiguous(), saved[0], saved[1], saved[2],
                                      ctx->saved_data["input_scale"].toDouble(),
                                      ctx->saved_data["input_grad"].toBool());
    gb = gb.to(static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt()));
    return {gx, gw, gb, Tensor(), Tensor()};
  }
};

Tensor conv_pool_autograd(const Tensor& x, const Tensor& weight, const Tensor& bias,
                          double input_scale, std::optional<at::ScalarType> out_dtype) {
  return ConvPoolFunction::apply(x, weight, bias, input_scale, out_dtype);
}

Tensor conv_pool_nograd(const Tensor& x, const Tensor& weight, const Tensor& bias,
                        double input_scale, std::optional<at::ScalarType> out_dtype) {
  return std::get<0>(cp_fwd_op().call(x, weight, bias, input_scale, resolve_out_dtype(x, out_dtype)));
}

}  // namespace

Tensor conv3x3_maxpool_relu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                            double input_scale, std::optional<at::ScalarType> out_dtype) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::conv3x3_maxpool_relu", "")
          .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, double,
                        std::optional<at::ScalarType>)>();
  return op.call(x, weight, bias, input_scale, out_dtype);
}

Tensor conv3x3_maxpool_relu_reference(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                      double input_scale, std::optional<at::ScalarType> out_dtype) {
  detail::conv_pool_check_inputs(x, weight, bias);
  const auto cd = cp_compute_dtype(x, weight);
  const Tensor z = at::conv2d(scaled_input(x, input_scale, cd), weight.to(cd), bias.to(cd), 1, 1);
  return at::relu(at::max_pool2d(z, {2, 2}, {2, 2})).to(resolve_out_dtype(x, out_dtype));
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) {
  m.impl("conv3x3_maxpool_relu", &strobe::ops::conv_pool_autograd);
}
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("conv3x3_maxpool_relu", &strobe::ops::conv_pool_nograd);
  m.impl("conv3x3_maxpool_relu_fwd", &strobe::ops::cp_fwd_cpu);
  m.impl("conv3x3_maxpool_relu_bwd", &strobe::ops::cp_bwd_cpu);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("conv3x3_maxpool_relu", &strobe::ops::conv_pool_nograd);
}
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("conv3x3_maxpool_relu", &strobe::ops::conv_pool_nograd);
  m.impl("conv3x3_maxpool_relu_fwd", &strobe::ops::cp_fwd_meta);
  m.impl("conv3x3_maxpool_relu_bwd", &strobe::ops::cp_bwd_meta);
}
