// CUDA glue of batch_norm_act_fwd / _bwd (kernels in cuda/batch_norm_act_kernels.cu): channels-last
// [N, C, H, W] activations (C % 8 == 0), fp32 weight, bias and running statistics. Anything else is
// an error naming what to change, never a silent copy into another layout.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda/batch_norm_act.h"
#include "strobe/ops/cuda_glue.h"

namespace strobe::ops {
namespace detail {
void batch_norm_act_check(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                          const at::Tensor& running_mean, const at::Tensor& running_var,
                          const std::optional<at::Tensor>& residual);
}  // namespace detail

namespace {

using at::Tensor;
using cuda::DType;

DType to_bn_dtype(at::ScalarType s) { return detail::kernel_dtype(s, "batch_norm_act (CUDA)", "x", detail::kFloatingTypes); }

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_activation(const Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous(at::MemoryFormat::ChannelsLast) && aligned16(t), "batch_norm_act (CUDA): ", what,
              " must be channels_last (x.contiguous(memory_format=torch.channels_last)) and 16-byte aligned");
}

void check_param(const Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && aligned16(t), "batch_norm_act (CUDA): ", what,
              " must be a contiguous float32 tensor, got ", t.scalar_type());
}

cuda::BnShape shape_of(const Tensor& x) {
  TORCH_CHECK(x.size(1) % 8 == 0 && x.size(1) < (1 << 30), "batch_norm_act (CUDA): the channel count must be a multiple of 8, got ",
              x.size(1));
  cuda::BnShape s;
  s.c = static_cast<int>(x.size(1));
  s.rows = x.numel() / x.size(1);
  return s;
}

std::tuple<Tensor, Tensor, Tensor> bna_fwd_cuda(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                            Tensor& running_mean, Tensor& running_var,
                                            const std::optional<Tensor>& residual, double momentum, double eps,
                                            bool relu) {
  detail::batch_norm_act_check(x, weight, bias, running_mean, running_var, residual);
  const DType dt = to_bn_dtype(x.scalar_type());
  const cuda::BnShape s = shape_of(x);
  check_activation(x, "x");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) check_activation(*residual, "residual");
  check_param(weight, "weight"), check_param(bias, "bias");
  check_param(running_mean, "running_mean"), check_param(running_var, "running_var");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto fopt = x.options().dtype(at::kFloat);
  Tensor y = at::empty_like(x, at::MemoryFormat::ChannelsLast);
  Tensor mean = at::empty({s.c}, fopt), invstd = at::empty({s.c}, fopt);
  if (x.numel() == 0) return {y, mean.zero_(), invstd.zero_()};
  Tensor ws = at::empty({cuda::batch_norm_act_workspace(s)}, fopt);
  C10_CUDA_CHECK(cuda::batch_norm_act_fwd(x.data_ptr(), has_res ? residual->data_ptr() : nullptr, dt,
                                          weight.data_ptr<float>(), bias.data_ptr<float>(),
                                          running_mean.data_ptr<float>(), running_var.data_ptr<float>(),
                                          static_cast<float>(momentum), static_cast<float>(eps), relu, y.data_ptr(),
                                          mean.data_ptr<float>(), invstd.data_ptr<float>(), ws.data_ptr<float>(), s,
                                          detail::current_stream()));
  return {y, mean, invstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> bna_bwd_cuda(const Tensor& grad_y, const Tensor& y, const Tensor& x,
                                                    const Tensor& weight, const Tensor& mean, const Tensor& invstd,
                                                    bool relu, bool residual_grad) {
  const DType dt = to_bn_dtype(x.scalar_type());
  const cuda::BnShape s = shape_of(x);
  TORCH_CHECK(grad_y.sizes() == x.sizes() && y.sizes() == x.sizes() && grad_y.device() == x.device(),
              "batch_norm_act_bwd: grad_y and y must match x ", x.sizes());
  // The gradient reaching a channels-last activation is channels-last in practice (cuDNN's
  // convolution backward writes it so); another layout is copied once here.
  const Tensor gy = grad_y.scalar_type() == x.scalar_type() ? grad_y.contiguous(at::MemoryFormat::ChannelsLast)
                                                            : grad_y.to(x.scalar_type()).contiguous(at::MemoryFormat::ChannelsLast);
  check_activation(gy, "grad_y"), check_activation(y, "y"), check_activation(x, "x");
  check_param(weight, "weight"), check_param(mean, "mean"), check_param(invstd, "invstd");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto fopt = x.options().dtype(at::kFloat);
  Tensor gx = at::empty_like(x, at::MemoryFormat::ChannelsLast);
  Tensor gres = residual_grad ? at::empty_like(x, at::MemoryFormat::ChannelsLast) : Tensor();
  Tensor gw = at::empty({s.c}, fopt), gb = at::empty({s.c}, fopt);
  if (x.numel() == 0) return {gx, gw.zero_(), gb.zero_(), gres};
  Tensor ws = at::empty({cuda::batch_norm_act_workspace(s)}, fopt);
  C10_CUDA_CHECK(cuda::batch_norm_act_bwd(gy.data_ptr(), y.data_ptr(), x.data_ptr(), dt, weight.data_ptr<float>(),
                                          mean.data_ptr<float>(), invstd.data_ptr<float>(), relu, gx.data_ptr(),
                                          residual_grad ? gres.data_ptr() : nullptr, gw.data_ptr<float>(),
                                          gb.data_ptr<float>(), ws.data_ptr<float>(), s, detail::current_stream()));
  return {gx, gw, gb, gres};
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("batch_norm_act_fwd", &strobe::ops::bna_fwd_cuda);
  m.impl("batch_norm_act_bwd", &strobe::ops::bna_bwd_cuda);
}
