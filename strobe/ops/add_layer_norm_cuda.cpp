// CUDA glue of add_layer_norm_fwd / _bwd and add_rms_norm_fwd / _bwd (kernels in cuda/fused_norm_kernels.cu).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda/fused_norm.h"
#include "strobe/ops/cuda_glue.h"
#include "strobe/ops/internal.h"

namespace strobe::ops {
namespace detail {
void add_layer_norm_check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                                 const at::Tensor& weight, const std::optional<at::Tensor>& bias);
void add_rms_norm_check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight);
}  // namespace detail

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

using detail::present;

cuda::DType half_or_float(at::ScalarType s, const char* what) {
  return detail::kernel_dtype(s, "add_layer_norm (CUDA)", what, detail::kFloatingTypes);
}

int checked_cols(const Tensor& x) {
  const int64_t c = x.size(-1);
  TORCH_CHECK(c >= 1 && c <= cuda::layer_norm_max_cols(), "add_layer_norm (CUDA): the normalised dimension must be 1..",
              cuda::layer_norm_max_cols(), ", got ", c);
  TORCH_CHECK(x.numel() / c < (1LL << 31), "add_layer_norm (CUDA): too many rows (", x.numel() / c, ")");
  return static_cast<int>(c);
}

// y_amax: when not null, also max |y| into it (a 0-dim fp32 tensor made here).
std::tuple<Tensor, Tensor, Tensor, Tensor> aln_fwd_impl(const Tensor& x, const OptTensor& delta, const Tensor& weight,
                                                        const OptTensor& bias, double eps, Tensor* y_amax) {
  detail::add_layer_norm_check_inputs(x, delta, weight, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::LayerNormFwdParams p;
  p.dtype = half_or_float(x.scalar_type(), "x");
  p.param_dtype = half_or_float(weight.scalar_type(), "weight");
  p.cols = checked_cols(x);
  p.rows = x.numel() / p.cols;
  p.eps = static_cast<float>(eps);
  const Tensor xc = x.contiguous();
  const Tensor wc = weight.contiguous();
  const Tensor dc = present(delta) ? delta->contiguous() : Tensor();
  const Tensor bc = present(bias) ? bias->contiguous() : Tensor();
  Tensor y = at::empty(x.sizes(), xc.options());
  Tensor sum = present(delta) ? at::empty(x.sizes(), xc.options()) : Tensor();
  const auto rows = x.sizes().slice(0, x.dim() - 1);
  Tensor mean = at::empty(rows, x.options().dtype(at::kFloat));
  Tensor rstd = at::empty(rows, x.options().dtype(at::kFloat));
  p.x = xc.data_ptr();
  p.delta = dc.defined() ? dc.data_ptr() : nullptr;
  p.weight = wc.data_ptr();
  p.bias = bc.defined() ? bc.data_ptr() : nullptr;
  p.sum = sum.defined() ? sum.data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  if (y_amax) {
    *y_amax = at::empty({}, x.options().dtype(at::kFloat));
    p.y_amax = y_amax->data_ptr<float>();
  }
  C10_CUDA_CHECK(cuda::layer_norm_fwd(p, detail::current_stream()));
  return {y, mean, rstd, sum};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> aln_fwd_cuda(const Tensor& x, const OptTensor& delta, const Tensor& weight,
                                                        const OptTensor& bias, double eps) {
  return aln_fwd_impl(x, delta, weight, bias, eps, nullptr);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> aln_fwd_amax_cuda(const Tensor& x, const OptTensor& delta,
                                                                     const Tensor& weight, const OptTensor& bias,
                                                                     double eps) {
  Tensor amax;
  auto [y, mean, rstd, sum] = aln_fwd_impl(x, delta, weight, bias, eps, &amax);
  return {y, mean, rstd, sum, amax};
}

std::tuple<Tensor, Tensor, Tensor> aln_bwd_cuda(const Tensor& dy, const OptTensor& dsum, const Tensor& input,
                                            const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                                            bool has_bias) {
  TORCH_CHECK(dy.sizes() == input.sizes() && dy.scalar_type() == input.scalar_type(),
              "add_layer_norm_bwd: dy must be ", input.sizes(), " ", input.scalar_type());
  TORCH_CHECK(!present(dsum) || (dsum->sizes() == input.sizes() && dsum->scalar_type() == input.scalar_type()),
              "add_layer_norm_bwd: dsum must be ", input.sizes(), " ", input.scalar_type());
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat &&
                  mean.numel() * input.size(-1) == input.numel() && rstd.numel() == mean.numel(),
              "add_layer_norm_bwd: mean / rstd must be fp32 with one value per row");
  const c10::cuda::CUDAGuard guard(input.device());
  cuda::LayerNormBwdParams p;
  p.dtype = half_or_float(input.scalar_type(), "input");
  p.param_dtype = half_or_float(weight.scalar_type(), "weight");
  p.cols = checked_cols(input);
  p.rows = input.numel() / p.cols;
  const Tensor dyc = dy.contiguous(), ic = input.contiguous(), wc = weight.contiguous();
  const Tensor mc = mean.contiguous(), rc = rstd.contiguous();
  const Tensor dsc = present(dsum) ? dsum->contiguous() : Tensor();
  Tensor dx = at::empty(input.sizes(), ic.options());
  const auto fopt = input.options().dtype(at::kFloat);
  Tensor dw = at::empty({p.cols}, fopt);
  Tensor db = has_bias ? at::empty({p.cols}, fopt) : Tensor();
  Tensor ws = at::empty({std::max<int64_t>(1, cuda::layer_norm_bwd_workspace(p.rows, p.cols, p.dtype))}, fopt);
  p.dy = dyc.data_ptr();
  p.dsum = dsc.defined() ? dsc.data_ptr() : nullptr;
  p.sum = ic.data_ptr();
  p.mean = mc.data_ptr<float>();
  p.rstd = rc.data_ptr<float>();
  p.weight = wc.data_ptr();
  p.dx = dx.data_ptr();
  p.dweight = dw.data_ptr<float>();
  p.dbias = db.defined() ? db.data_ptr<float>() : nullptr;
  p.workspace = ws.data_ptr<float>();
  C10_CUDA_CHECK(cuda::layer_norm_bwd(p, detail::current_stream()));
  return {dx, dw.to(weight.scalar_type()), db.defined() ? db.to(weight.scalar_type()) : db};
}

// add_rms_norm: the RMS mode of the same kernels (no mean, no bias).
std::tuple<Tensor, Tensor, Tensor> arn_fwd_impl(const Tensor& x, const OptTensor& delta, const Tensor& weight,
                                                double eps, Tensor* y_amax) {
  detail::add_rms_norm_check_inputs(x, delta, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::LayerNormFwdParams p;
  p.rms = true;
  p.dtype = detail::kernel_dtype(x, "add_rms_norm (CUDA)", "x", detail::kFloatingTypes);
  p.param_dtype = detail::kernel_dtype(weight, "add_rms_norm (CUDA)", "weight", detail::kFloatingTypes);
  p.cols = checked_cols(x);
  p.rows = x.numel() / p.cols;
  p.eps = static_cast<float>(eps);
  const Tensor xc = x.contiguous();
  const Tensor wc = weight.contiguous();
  const Tensor dc = present(delta) ? delta->contiguous() : Tensor();
  Tensor y = at::empty(x.sizes(), xc.options());
  Tensor sum = present(delta) ? at::empty(x.sizes(), xc.options()) : Tensor();
  Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  p.x = xc.data_ptr();
  p.delta = dc.defined() ? dc.data_ptr() : nullptr;
  p.weight = wc.data_ptr();
  p.sum = sum.defined() ? sum.data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.rstd = rstd.data_ptr<float>();
  if (y_amax) {
    *y_amax = at::empty({}, x.options().dtype(at::kFloat));
    p.y_amax = y_amax->data_ptr<float>();
  }
  C10_CUDA_CHECK(cuda::layer_norm_fwd(p, detail::current_stream()));
  return {y, rstd, sum};
}

std::tuple<Tensor, Tensor, Tensor> arn_fwd_cuda(const Tensor& x, const OptTensor& delta, const Tensor& weight,
                                                double eps) {
  return arn_fwd_impl(x, delta, weight, eps, nullptr);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> arn_fwd_amax_cuda(const Tensor& x, const OptTensor& delta,
                                                             const Tensor& weight, double eps) {
  Tensor amax;
  auto [y, rstd, sum] = arn_fwd_impl(x, delta, weight, eps, &amax);
  return {y, rstd, sum, amax};
}

std::tuple<Tensor, Tensor> arn_bwd_cuda(const Tensor& dy, const OptTensor& dsum, const Tensor& input,
                                        const Tensor& rstd, const Tensor& weight) {
  TORCH_CHECK(dy.sizes() == input.sizes() && dy.scalar_type() == input.scalar_type(), "add_rms_norm_bwd: dy must be ",
              input.sizes(), " ", input.scalar_type());
  TORCH_CHECK(!present(dsum) || (dsum->sizes() == input.sizes() && dsum->scalar_type() == input.scalar_type()),
              "add_rms_norm_bwd: dsum must be ", input.sizes(), " ", input.scalar_type());
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() * input.size(-1) == input.numel(),
              "add_rms_norm_bwd: rstd must be fp32 with one value per row");
  const c10::cuda::CUDAGuard guard(input.device());
  cuda::LayerNormBwdParams p;
  p.rms = true;
  p.dtype = detail::kernel_dtype(input, "add_rms_norm (CUDA)", "input", detail::kFloatingTypes);
  p.param_dtype = detail::kernel_dtype(weight, "add_rms_norm (CUDA)", "weight", detail::kFloatingTypes);
  p.cols = checked_cols(input);
  p.rows = input.numel() / p.cols;
  const Tensor dyc = dy.contiguous(), ic = input.contiguous(), wc = weight.contiguous(), rc = rstd.contiguous();
  const Tensor dsc = present(dsum) ? dsum->contiguous() : Tensor();
  Tensor dx = at::empty(input.sizes(), ic.options());
  const auto fopt = input.options().dtype(at::kFloat);
  Tensor dw = at::empty({p.cols}, fopt);
  Tensor ws = at::empty({std::max<int64_t>(1, cuda::layer_norm_bwd_workspace(p.rows, p.cols, p.dtype))}, fopt);
  p.dy = dyc.data_ptr();
  p.dsum = dsc.defined() ? dsc.data_ptr() : nullptr;
  p.sum = ic.data_ptr();
  p.rstd = rc.data_ptr<float>();
  p.weight = wc.data_ptr();
  p.dx = dx.data_ptr();
  p.dweight = dw.data_ptr<float>();
  p.workspace = ws.data_ptr<float>();
  C10_CUDA_CHECK(cuda::layer_norm_bwd(p, detail::current_stream()));
  return {dx, dw.to(weight.scalar_type())};
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("add_layer_norm_fwd", &strobe::ops::aln_fwd_cuda);
  m.impl("add_layer_norm_bwd", &strobe::ops::aln_bwd_cuda);
  m.impl("add_rms_norm_fwd", &strobe::ops::arn_fwd_cuda);
  m.impl("add_rms_norm_fwd_amax", &strobe::ops::arn_fwd_amax_cuda);
  m.impl("add_layer_norm_fwd_amax", &strobe::ops::aln_fwd_amax_cuda);
  m.impl("add_rms_norm_bwd", &strobe::ops::arn_bwd_cuda);
}
