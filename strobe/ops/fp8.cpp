// fp8_quantize: a tensor's float8 copy (and its transpose) with tensorwise dynamic scaling, the input
// of a scaled GEMM (docs/OPS.md). Argument checks shared by every device, the CPU implementation (ATen
// ops: the reference the CUDA kernels match bit for bit), the Meta kernel and the C++ wrapper. CUDA
// kernels: cuda/fp8_kernels.cu, glue fp8_cuda.cpp.
// fp8_linear: y = x W^T (+ b) with its three GEMMs in float8 (at::_scaled_mm: cuBLASLt on the GPU,
// ATen's CPU implementation here), the operands made by fp8_quantize; one implementation for every
// device, Meta kernels, autograd and the C++ wrapper. fp8_linear_swiglu: the gate+up GEMM and swiglu
// with the amax of swiglu's output and of its input gradient from swiglu's kernels.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/ops.h"
#include "strobe/ops/internal.h"

namespace strobe::ops {
namespace detail {

// Used by the CUDA glue too.
// The input types of a float8 quantization (fp8_quantize, fp8_linear).
bool fp8_input_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void fp8_check_input(const at::Tensor& x, at::ScalarType dtype, const std::optional<at::Tensor>& amax) {
  TORCH_CHECK(x.defined() && x.dim() == 2, "fp8_quantize: x must be 2-D [rows, cols], got ", x.defined() ? x.dim() : 0,
              " dimensions");
  TORCH_CHECK(fp8_input_type(x.scalar_type()),
              "fp8_quantize: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "fp8_quantize: dtype must be Float8_e4m3fn or Float8_e5m2, got ", dtype);
  TORCH_CHECK(!amax || !amax->defined() ||
                  (amax->dim() == 0 && amax->scalar_type() == at::kFloat && amax->device() == x.device()),
              "fp8_quantize: amax must be a 0-dim float32 tensor on x's device");
}

double fp8_max(at::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn ? 448.0 : 57344.0; }

// amax propagates a NaN (and fp8q_cpu's clamp_min keeps it).
at::Tensor fp8_amax(const at::Tensor& x) {
  return x.numel() == 0 ? at::zeros({}, x.options().dtype(at::kFloat)) : x.abs().amax().to(at::kFloat);
}

}  // namespace detail

namespace {

using at::Tensor;

constexpr double kFp8MinAmax = 1e-12;

using OptTensor = std::optional<Tensor>;
using detail::present;

std::tuple<Tensor, Tensor, Tensor> fp8q_cpu(const Tensor& x, at::ScalarType dtype, bool transpose,
                                            const OptTensor& given) {
  detail::fp8_check_input(x, dtype, given);
  const double max = detail::fp8_max(dtype);
  const Tensor xf = x.to(at::kFloat);
  const Tensor amax = present(given) ? *given : detail::fp8_amax(xf);
  const Tensor scale = at::full({}, max, xf.options()) / amax.clamp_min(kFp8MinAmax);
  const Tensor q = (xf * scale).clamp(-max, max).to(dtype);
  const Tensor q_t = transpose ? q.t().contiguous() : at::empty({0}, q.options());
  return {q, q_t, at::reciprocal(scale)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fp8qs_cpu(const Tensor& x, at::ScalarType dtype, bool transpose,
                                                    const OptTensor& given) {
  auto [q, q_t, scale_inv] = fp8q_cpu(x, dtype, transpose, given);
  return {q, q_t, scale_inv, x.sum(0, false, at::kFloat)};
}

std::tuple<Tensor, Tensor, Tensor> fp8q_meta(const Tensor& x, at::ScalarType dtype, bool transpose,
                                             const OptTensor& given) {
  detail::fp8_check_input(x, dtype, given);
  const auto opts = x.options().dtype(dtype);
  Tensor q = at::empty_symint(x.sym_sizes(), opts);
  Tensor q_t = transpose ? at::empty_symint({x.sym_size(1), x.sym_size(0)}, opts) : at::empty({0}, opts);
  return {q, q_t, at::empty({}, x.options().dtype(at::kFloat))};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fp8qs_meta(const Tensor& x, at::ScalarType dtype, bool transpose,
                                                     const OptTensor& given) {
  auto [q, q_t, scale_inv] = fp8q_meta(x, dtype, transpose, given);
  return {q, q_t, scale_inv, at::empty_symint({x.sym_size(1)}, x.options().dtype(at::kFloat))};
}

// --- fp8_linear ------------------------------------------------------------------------------------

using Fp8LinearFwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                                           const OptTensor&, bool, bool, const OptTensor&);
using Fp8LinearBwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                           const Tensor&, at::ScalarType, std::optional<at::ScalarType>,
                                                           std::array<bool, 3>, const OptTensor&);
using Fp8QuantizeSumSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, at::ScalarType, bool, const OptTensor&);
using SwigluAmaxFwdSig = std::tuple<Tensor, Tensor>(const Tensor&);
using SwigluAmaxBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&);

void fp8_linear_check(const Tensor& x, const Tensor& w, const OptTensor& b) {
  TORCH_CHECK(x.defined() && w.defined() && x.dim() >= 1 && w.dim() == 2 && x.sym_size(-1) == w.sym_size(1),
              "fp8_linear: x must be [..., in_features] and weight [out_features, in_features], got ",
              x.defined() ? x.sym_sizes() : c10::SymIntArrayRef{}, " and ", w.defined() ? w.sym_sizes() : c10::SymIntArrayRef{});
  TORCH_CHECK(detail::fp8_input_type(x.scalar_type()) && detail::fp8_input_type(w.scalar_type()),
              "fp8_linear: x and weight must be float32, bfloat16 or float16, got ", x.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(w.sym_size(0) % 16 == 0 && w.sym_size(1) % 16 == 0,
              "fp8_linear: out_features and in_features must be multiples of 16 (the float8 GEMM's rule), got weight ",
              w.sym_sizes());
  TORCH_CHECK(!present(b) || (b->dim() == 1 && b->sym_size(0) == w.sym_size(0) && detail::fp8_input_type(b->scalar_type())),
              "fp8_linear: bias must be [out_features] (", w.sym_size(0), ") in float32, bfloat16 or float16");
  TORCH_CHECK(w.device() == x.device() && (!present(b) || b->device() == x.device()),
              "fp8_linear: every tensor must be on x's device");
}

// The rows of a GEMM's reduction over tokens (d weight = dY^T X) padded to a multiple of 16, the float8
// GEMM's rule for it: q_t [C, M] with zero columns appended (zeros add nothing to the sums).
Tensor fp8l_pad_cols(const Tensor& q_t) {
  const int64_t m = q_t.size(1), padded = (m + 15) / 16 * 16;
  if (m == padded) return q_t;
  Tensor out = at::zeros({q_t.size(0), padded}, q_t.options());
  out.narrow(1, 0, m).copy_(q_t);
  return out;
}

// (y, x_t, x_scale_inv, w_t, w_scale_inv). x and weight quantized to e4m3 (tensorwise, now; x with
// x_amax when given), y =
// _scaled_mm(q_x, q_w^T) in x's dtype with fp32 accumulation (fast accumulation: the forward GEMM, as
// torchao's recipe). x_t (e4m3 [K, M padded to 16], for d weight) is made when save_x_t, w_t (e4m3
// [K, N], for d x) when save_w_t; otherwise empty [0] tensors. The bias is added in the GEMM's epilogue
// when its dtype is y's 16-bit dtype, after it otherwise.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fp8l_fwd(const Tensor& x, const Tensor& w, const OptTensor& b,
                                                            bool save_x_t, bool save_w_t, const OptTensor& x_amax) {
  fp8_linear_check(x, w, b);
  const int64_t n = w.size(0), k = w.size(1);
  const Tensor x2 = x.reshape({-1, k});
  auto [qx, qx_t, sx] = fp8_quantize(x2, at::kFloat8_e4m3fn, save_x_t, x_amax);
  auto [qw, qw_t, sw] = fp8_quantize(w, at::kFloat8_e4m3fn, save_w_t);
  const auto out_dtype = x.scalar_type();
  const bool bias_in_gemm = present(b) && b->scalar_type() == out_dtype && out_dtype != at::kFloat;
  Tensor y2;
  if (x2.size(0) == 0) {
    y2 = at::empty({0, n}, x.options());
  } else {
    y2 = at::_scaled_mm(qx, qw.t(), sx, sw, bias_in_gemm ? b : std::nullopt, std::nullopt, out_dtype,
                        /*use_fast_accum=*/true);
    if (present(b) && !bias_in_gemm) y2.add_(*b);
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return {y2.view(sizes), save_x_t ? fp8l_pad_cols(qx_t) : at::empty({0}, qx.options()), sx,
          save_w_t ? qw_t : at::empty({0}, qw.options()), sw};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fp8l_fwd_meta(const Tensor& x, const Tensor& w, const OptTensor& b,
                                                                 bool save_x_t, bool save_w_t, const OptTensor& /*x_amax*/) {
  fp8_linear_check(x, w, b);
  std::vector<c10::SymInt> sizes(x.sym_sizes().begin(), x.sym_sizes().end());
  sizes.back() = w.sym_size(0);
  const auto f8 = x.options().dtype(at::kFloat8_e4m3fn);
  const c10::SymInt m = x.sym_numel() / w.sym_size(1);
  const auto scale = [&] { return at::empty({}, x.options().dtype(at::kFloat)); };
  return {at::empty_symint(sizes, x.options()),
          save_x_t ? at::empty_symint({w.sym_size(1), (m + 15) / 16 * 16}, f8) : at::empty({0}, f8), scale(),
          save_w_t ? at::empty_symint({w.sym_size(1), w.sym_size(0)}, f8) : at::empty({0}, f8), scale()};
}

const c10::TypedOperatorHandle<Fp8QuantizeSumSig>& fp8qs_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::fp8_quantize_sum", "").typed<Fp8QuantizeSumSig>();
  return op;
}

// (dx, dweight, dbias) as output_mask asks (undefined otherwise). dy quantized to e5m2 (the gradient's
// range; e5m2 x e4m3 GEMMs, fp32 accumulation without fast accumulation): dx = _scaled_mm(q_dy, w)
// in dy's dtype, dweight = _scaled_mm(q_dy^T, x) in weight_dtype over the tokens padded to 16, dbias
// = the fp32 sum of dy's rows in bias_dtype. dy_amax: max |dy| from dy's producer.
std::tuple<Tensor, Tensor, Tensor> fp8l_bwd(const Tensor& dy, const Tensor& x_t, const Tensor& sx, const Tensor& w_t,
                                            const Tensor& sw, at::ScalarType w_dtype, std::optional<at::ScalarType> b_dtype,
                                            std::array<bool, 3> mask, const OptTensor& dy_amax) {
  const int64_t n = dy.size(-1);
  const Tensor dy2 = dy.reshape({-1, n});
  const int64_t m = dy2.size(0);
  Tensor dx, dw, db;
  const bool want_db = mask[2] && b_dtype;
  if (!mask[0] && !mask[1]) {  // only the bias: no GEMM, no quantization
    if (want_db) db = dy2.sum(0, false, at::kFloat).to(*b_dtype);
    return {dx, dw, db};
  }
  // The bias gradient from the cast's read of dy (fp8_quantize_sum) rather than a pass of its own.
  Tensor qdy, qdy_t, sdy;
  if (want_db) {
    Tensor sums;
    std::tie(qdy, qdy_t, sdy, sums) = fp8qs_op().call(dy2, at::kFloat8_e5m2, mask[1], dy_amax);
    db = sums.to(*b_dtype);
  } else {
    std::tie(qdy, qdy_t, sdy) = fp8_quantize(dy2, at::kFloat8_e5m2, mask[1], dy_amax);
  }
  if (mask[0]) {
    TORCH_CHECK(w_t.dim() == 2 && w_t.size(1) == n, "fp8_linear: the backward's d x needs the saved weight transpose");
    const int64_t k = w_t.size(0);
    const Tensor dx2 = m == 0 ? at::empty({0, k}, dy.options())
                              : at::_scaled_mm(qdy, w_t.t(), sdy, sw, std::nullopt, std::nullopt, dy.scalar_type(), false);
    std::vector<int64_t> sizes = dy.sizes().vec();
    sizes.back() = k;
    dx = dx2.view(sizes);
  }
  if (mask[1]) {
    TORCH_CHECK(x_t.dim() == 2 && x_t.size(1) == (m + 15) / 16 * 16,
                "fp8_linear: the backward's d weight needs the saved input transpose");
    const int64_t k = x_t.size(0);
    dw = m == 0 ? at::zeros({n, k}, dy.options().dtype(w_dtype))
                : at::_scaled_mm(fp8l_pad_cols(qdy_t), x_t.t(), sdy, sx, std::nullopt, std::nullopt, w_dtype, false);
  }
  return {dx, dw, db};
}

std::tuple<Tensor, Tensor, Tensor> fp8l_bwd_meta(const Tensor& dy, const Tensor& x_t, const Tensor& /*sx*/,
                                                 const Tensor& w_t, const Tensor& /*sw*/, at::ScalarType w_dtype,
                                                 std::optional<at::ScalarType> b_dtype, std::array<bool, 3> mask,
                                                 const OptTensor& /*dy_amax*/) {
  Tensor dx, dw, db;
  const c10::SymInt n = dy.sym_size(-1);
  if (mask[0]) {
    std::vector<c10::SymInt> sizes(dy.sym_sizes().begin(), dy.sym_sizes().end());
    sizes.back() = w_t.sym_size(0);
    dx = at::empty_symint(sizes, dy.options());
  }
  if (mask[1]) dw = at::empty_symint({n, x_t.sym_size(0)}, dy.options().dtype(w_dtype));
  if (mask[2] && b_dtype) db = at::empty_symint({n}, dy.options().dtype(*b_dtype));
  return {dx, dw, db};
}

const c10::TypedOperatorHandle<Fp8LinearFwdSig>& fp8l_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::fp8_linear_fwd", "").typed<Fp8LinearFwdSig>();
  return op;
}
const c10::TypedOperatorHandle<Fp8LinearBwdSig>& fp8l_bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::fp8_linear_bwd", "").typed<Fp8LinearBwdSig>();
  return op;
}
const c10::TypedOperatorHandle<SwigluAmaxFwdSig>& sw_amax_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::swiglu_fwd_amax", "").typed<SwigluAmaxFwdSig>();
  return op;
}
const c10::TypedOperatorHandle<SwigluAmaxBwdSig>& sw_amax_bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::swiglu_bwd_amax", "").typed<SwigluAmaxBwdSig>();
  return op;
}

// Saves the float8 transposes the backward's GEMMs read (1 byte an element), not x or the weight: x^T
// only when the weight needs a gradient, the weight's only when x does.
class Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& w, const OptTensor& b,
                        const OptTensor& x_amax) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, x_t, sx, w_t, sw] = fp8l_fwd_op().call(x, w, b, w.requires_grad(), x.requires_grad(), x_amax);
    ctx->save_for_backward({x_t, sx, w_t, sw});
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    ctx->saved_data["b_dtype"] = present(b) ? static_cast<int64_t>(b->scalar_type()) : int64_t{-1};
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const int64_t b_dtype = ctx->saved_data["b_dtype"].toInt();
    const std::array<bool, 3> mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                      b_dtype >= 0 && ctx->needs_input_grad(2)};
    auto [dx, dw, db] = fp8l_bwd_op().call(
        grads[0], saved[0], saved[1], saved[2], saved[3], static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt()),
        b_dtype >= 0 ? std::optional<at::ScalarType>(static_cast<at::ScalarType>(b_dtype)) : std::nullopt, mask,
        std::nullopt);
    return {dx, dw, db, Tensor()};
  }
};

Tensor fp8l_autograd(const Tensor& x, const Tensor& w, const OptTensor& b, const OptTensor& x_amax) {
  return Fp8LinearFunction::apply(x, w, b, x_amax);
}
Tensor fp8l_nograd(const Tensor& x, const Tensor& w, const OptTensor& b, const OptTensor& x_amax) {
  return std::get<0>(fp8l_fwd_op().call(x, w, b, false, false, x_amax));
}

// --- fp8_linear_swiglu -----------------------------------------------------------------------------

void fp8_linear_swiglu_check(const Tensor& x, const Tensor& w) {
  fp8_linear_check(x, w, std::nullopt);
  TORCH_CHECK(w.sym_size(0) % 32 == 0, "fp8_linear_swiglu: weight must hold gate and up (2 x F rows, F a multiple of 16), got ",
              w.sym_sizes());
}

// Saves what fp8_linear saves and gate_up (swiglu's backward recomputes silu(gate) from it, as swiglu
// does); y_amax is not differentiable.
class Fp8LinearSwigluFunction : public torch::autograd::Function<Fp8LinearSwigluFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& w,
                                                const OptTensor& x_amax) {
    at::AutoDispatchBelowADInplaceOrView guard;
    fp8_linear_swiglu_check(x, w);
    auto [gu, x_t, sx, w_t, sw] = fp8l_fwd_op().call(x, w, std::nullopt, w.requires_grad(), x.requires_grad(), x_amax);
    auto [y, amax] = sw_amax_fwd_op().call(gu);
    ctx->save_for_backward({x_t, sx, w_t, sw, gu});
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    ctx->mark_non_differentiable({amax});
    return {y, amax};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dgu, dgu_amax] = sw_amax_bwd_op().call(grads[0].contiguous(), saved[4]);
    const std::array<bool, 3> mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(1), false};
    auto [dx, dw, db] = fp8l_bwd_op().call(dgu, saved[0], saved[1], saved[2], saved[3],
                                           static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt()), std::nullopt,
                                           mask, dgu_amax);
    return {dx, dw, Tensor()};
  }
};

std::tuple<Tensor, Tensor> fp8ls_autograd(const Tensor& x, const Tensor& w, const OptTensor& x_amax) {
  auto out = Fp8LinearSwigluFunction::apply(x, w, x_amax);
  return {out[0], out[1]};
}
std::tuple<Tensor, Tensor> fp8ls_nograd(const Tensor& x, const Tensor& w, const OptTensor& x_amax) {
  fp8_linear_swiglu_check(x, w);
  return sw_amax_fwd_op().call(std::get<0>(fp8l_fwd_op().call(x, w, std::nullopt, false, false, x_amax)));
}

}  // namespace

torch::Tensor fp8_linear(const torch::Tensor& x, const torch::Tensor& weight, const std::optional<torch::Tensor>& bias,
                         const std::optional<torch::Tensor>& x_amax) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::fp8_linear", "")
                             .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&)>();
  return op.call(x, weight, bias, x_amax);
}

std::tuple<torch::Tensor, torch::Tensor> fp8_linear_swiglu(const torch::Tensor& x, const torch::Tensor& weight,
                                                           const std::optional<torch::Tensor>& x_amax) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::fp8_linear_swiglu", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&)>();
  return op.call(x, weight, x_amax);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> fp8_quantize(const torch::Tensor& x, at::ScalarType dtype,
                                                                     bool transpose,
                                                                     const std::optional<torch::Tensor>& amax) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::fp8_quantize", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, at::ScalarType, bool, const OptTensor&)>();
  return op.call(x, dtype, transpose, amax);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) {
  m.impl("fp8_linear", &strobe::ops::fp8l_autograd);
  m.impl("fp8_linear_swiglu", &strobe::ops::fp8ls_autograd);
}
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("fp8_linear_swiglu", &strobe::ops::fp8ls_nograd);
  m.impl("fp8_quantize", &strobe::ops::fp8q_cpu);
  m.impl("fp8_quantize_sum", &strobe::ops::fp8qs_cpu);
  m.impl("fp8_linear", &strobe::ops::fp8l_nograd);
  m.impl("fp8_linear_fwd", &strobe::ops::fp8l_fwd);
  m.impl("fp8_linear_bwd", &strobe::ops::fp8l_bwd);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("fp8_linear_swiglu", &strobe::ops::fp8ls_nograd);
  m.impl("fp8_linear", &strobe::ops::fp8l_nograd);
  m.impl("fp8_linear_fwd", &strobe::ops::fp8l_fwd);
  m.impl("fp8_linear_bwd", &strobe::ops::fp8l_bwd);
}
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("fp8_linear_swiglu", &strobe::ops::fp8ls_nograd);
  m.impl("fp8_quantize", &strobe::ops::fp8q_meta);
  m.impl("fp8_quantize_sum", &strobe::ops::fp8qs_meta);
  m.impl("fp8_linear", &strobe::ops::fp8l_nograd);
  m.impl("fp8_linear_fwd", &strobe::ops::fp8l_fwd_meta);
  m.impl("fp8_linear_bwd", &strobe::ops::fp8l_bwd_meta);
}
