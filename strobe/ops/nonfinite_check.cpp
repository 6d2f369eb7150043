// nonfinite_check: argument checks, CPU reference, C++ wrapper.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "strobe/ops/ops.h"

namespace strobe::ops {

namespace detail {
void nonfinite_check_args(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "nonfinite_check: the tensor list is empty");
  const at::Device device = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "nonfinite_check: tensor ", i, " is undefined");
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), "nonfinite_check: tensor ", i,
                " must be floating point, got ", t.scalar_type());
    TORCH_CHECK(t.device() == device, "nonfinite_check: tensor ", i, " is on ", t.device(),
                " but tensor 0 is on ", device);
  }
}
}  // namespace detail

namespace {

std::tuple<at::Tensor, at::Tensor> nonfinite_check_cpu(at::TensorList tensors, bool compute_norm) {
  detail::nonfinite_check_args(tensors);
  bool found = false;
  double sumsq = 0.0;
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    found = found || !at::isfinite(t).all().item<bool>();
    if (compute_norm) sumsq += t.to(at::kDouble).square().sum().item<double>();
  }
  const auto opt = tensors[0].options().dtype(at::kFloat);
  at::Tensor norm = compute_norm ? at::scalar_tensor(std::sqrt(sumsq), opt) : at::Tensor();
  return {at::scalar_tensor(found ? 1.0 : 0.0, opt), norm};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> nonfinite_check(torch::TensorList tensors,
                                                         bool compute_norm) {
  if (tensors.empty()) {
    return {at::zeros({}, at::kFloat), compute_norm ? at::zeros({}, at::kFloat) : at::Tensor()};
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::nonfinite_check", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(at::TensorList, bool)>();
  return op.call(tensors, compute_norm);
}

bool built_with_cuda() {
#ifdef STROBE_OPS_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("nonfinite_check", &strobe::ops::nonfinite_check_cpu);
}
