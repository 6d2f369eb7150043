// CUDA kernels of fused_adamw_ / fused_adam_ / fused_sgd_ (launchers in
// cuda/multi_tensor_kernels.cu): one update launch per group (+ one step-count launch).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda_glue.h"

namespace strobe::ops {
namespace detail {
at::Device check_adam_args(const char* op, at::TensorList params, at::TensorList grads,
                           at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                           at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr,
                           double beta1, double beta2, double eps, double weight_decay,
                           bool amsgrad, const std::optional<at::Tensor>& found,
                           const std::optional<at::Tensor>& mult);
at::Device check_sgd_args(const char* op, at::TensorList params, at::TensorList grads,
                          at::TensorList momentum_buffers, at::TensorList steps, double lr,
                          double momentum, double dampening, double weight_decay, bool nesterov,
                          const std::optional<at::Tensor>& found,
                          const std::optional<at::Tensor>& mult);
void check_lr_tensor(const std::optional<at::Tensor>& t, const at::Device& device, const char* op);
at::Device check_ema_args(at::TensorList averages, at::TensorList sources, double weight,
                          const std::optional<at::Tensor>& skip);
}  // namespace detail

namespace {

using at::Tensor;
using at::TensorList;

constexpr std::initializer_list<cuda::DType> kGradTypes = {cuda::DType::kFloat32, cuda::DType::kBFloat16,
                                                           cuda::DType::kFloat16, cuda::DType::kFloat64};

// Written in place by the kernel, which walks memory flat: must be dense fp32 (no silent copies that
// would drop the update), and laid out like the parameter (channels_last parameters are dense but
// not contiguous; their state and gradients then share their strides).
float* inplace_fp32(const Tensor& t, const Tensor& param, const char* op, const char* what, size_t i) {
  const bool dense = t.is_non_overlapping_and_dense() && t.strides() == param.strides();
  TORCH_CHECK(t.scalar_type() == at::kFloat && dense, op, ": ", what, "[", i,
              "] must be a dense float32 tensor on CUDA laid out like params[", i, "] (fp32 master weights), got ",
              t.scalar_type(), dense ? "" : " with other strides");
  return t.data_ptr<float>();
}

// The gradient in the parameter's memory order: as it is when the strides agree (what autograd
// produces), else a copy laid out like the parameter.
const Tensor& grad_like_param(const Tensor& g, const Tensor& p, std::vector<Tensor>& keep) {
  if (g.strides() == p.strides() && g.is_non_overlapping_and_dense()) return g;
  return keep.emplace_back(at::empty_like(p, g.options()).copy_(g));
}

const float* scalar_ptr(const std::optional<Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<float>() : nullptr;
}

const double* lr_ptr(const std::optional<Tensor>& t, const at::Device& device, const char* op) {
  detail::check_lr_tensor(t, device, op);
  return t.has_value() && t->defined() ? t->data_ptr<double>() : nullptr;
}

void adam_cuda(const char* op, bool decoupled, TensorList params, TensorList grads,
               TensorList exp_avgs, TensorList exp_avg_sqs, TensorList max_exp_avg_sqs,
               TensorList steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool amsgrad, const std::optional<Tensor>& found,
               const std::optional<Tensor>& mult, const std::optional<Tensor>& lr_t) {
  const at::Device device =
      detail::check_adam_args(op, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                              lr, beta1, beta2, eps, weight_decay, amsgrad, found, mult);
  const c10::cuda::CUDAGuard guard(device);
  std::vector<Tensor> keep;
  std::vector<cuda::AdamTensor> meta(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& g = grad_like_param(grads[i], params[i], keep);
    cuda::AdamTensor& m = meta[i];
    m.param = inplace_fp32(params[i], params[i], op, "params", i);
    m.grad = g.data_ptr();
    m.grad_dtype = detail::kernel_dtype(g, op, "grads", kGradTypes);
    m.exp_avg = inplace_fp32(exp_avgs[i], params[i], op, "exp_avgs", i);
    m.exp_avg_sq = inplace_fp32(exp_avg_sqs[i], params[i], op, "exp_avg_sqs", i);
    m.max_exp_avg_sq = amsgrad ? inplace_fp32(max_exp_avg_sqs[i], params[i], op, "max_exp_avg_sqs", i)
                               : nullptr;
    m.step = steps[i].data_ptr<float>();
    m.numel = params[i].numel();
  }
  cuda::AdamHyper h{lr, beta1, beta2, eps, weight_decay, amsgrad, decoupled, scalar_ptr(found),
                    scalar_ptr(mult), lr_ptr(lr_t, device, op)};
  C10_CUDA_CHECK(cuda::fused_adam(meta.data(), static_cast<int>(meta.size()), h,
                                  detail::current_stream()));
}

void fused_adamw_cuda(TensorList params, TensorList grads, TensorList exp_avgs,
                      TensorList exp_avg_sqs, TensorList max_exp_avg_sqs, TensorList steps,
                      double lr, double beta1, double beta2, double eps, double weight_decay,
                      bool amsgrad, const std::optional<Tensor>& found,
                      const std::optional<Tensor>& mult, const std::optional<Tensor>& lr_t) {
  adam_cuda("fused_adamw_", true, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            lr, beta1, beta2, eps, weight_decay, amsgrad, found, mult, lr_t);
}

void fused_adam_cuda(TensorList params, TensorList grads, TensorList exp_avgs,
                     TensorList exp_avg_sqs, TensorList max_exp_avg_sqs, TensorList steps,
                     double lr, double beta1, double beta2, double eps, double weight_decay,
                     bool amsgrad, const std::optional<Tensor>& found,
                     const std::optional<Tensor>& mult, const std::optional<Tensor>& lr_t) {
  adam_cuda("fused_adam_", false, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            lr, beta1, beta2, eps, weight_decay, amsgrad, found, mult, lr_t);
}

void fused_sgd_cuda(TensorList params, TensorList grads, TensorList momentum_buffers,
                    TensorList steps, double lr, double momentum, double dampening,
                    double weight_decay, bool nesterov, const std::optional<Tensor>& found,
                    const std::optional<Tensor>& mult, const std::optional<Tensor>& lr_t) {
  const char* op = "fused_sgd_";
  const at::Device device =
      detail::check_sgd_args(op, params, grads, momentum_buffers, steps, lr, momentum, dampening,
                             weight_decay, nesterov, found, mult);
  const c10::cuda::CUDAGuard guard(device);
  const bool with_momentum = momentum != 0;
  std::vector<Tensor> keep;
  std::vector<cuda::SgdTensor> meta(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& g = grad_like_param(grads[i], params[i], keep);
    cuda::SgdTensor& m = meta[i];
    m.param = inplace_fp32(params[i], params[i], op, "params", i);
    m.grad = g.data_ptr();
    m.grad_dtype = detail::kernel_dtype(g, op, "grads", kGradTypes);
    m.momentum_buffer =
        with_momentum ? inplace_fp32(momentum_buffers[i], params[i], op, "momentum_buffers", i) : nullptr;
    m.step = with_momentum ? steps[i].data_ptr<float>() : nullptr;
    m.numel = params[i].numel();
  }
  cuda::SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, scalar_ptr(found),
                   scalar_ptr(mult), lr_ptr(lr_t, device, op)};
  C10_CUDA_CHECK(cuda::fused_sgd(meta.data(), static_cast<int>(meta.size()), h,
                                 detail::current_stream()));
}

void ema_update_cuda(TensorList averages, TensorList sources, double weight, const std::optional<Tensor>& skip) {
  const char* op = "ema_update_";
  const at::Device device = detail::check_ema_args(averages, sources, weight, skip);
  if (averages.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  std::vector<cuda::EmaTensor> meta(averages.size());
  for (size_t i = 0; i < averages.size(); ++i) {
    meta[i].avg = averages[i].data_ptr<float>();
    meta[i].src = sources[i].data_ptr();
    meta[i].numel = averages[i].numel();
    meta[i].src_dtype = detail::kernel_dtype(sources[i], op, "sources", kGradTypes);
  }
  const cuda::EmaHyper h{static_cast<float>(weight), scalar_ptr(skip)};
  C10_CUDA_CHECK(cuda::ema_update(meta.data(), static_cast<int>(meta.size()), h, detail::current_stream()));
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("fused_adamw_", &strobe::ops::fused_adamw_cuda);
  m.impl("fused_adam_", &strobe::ops::fused_adam_cuda);
  m.impl("fused_sgd_", &strobe::ops::fused_sgd_cuda);
  m.impl("ema_update_", &strobe::ops::ema_update_cuda);
}
