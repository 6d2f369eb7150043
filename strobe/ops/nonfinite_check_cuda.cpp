// CUDA kernel of nonfinite_check (launcher in cuda/multi_tensor_kernels.cu): one launch over the
// whole list (several past kNonfiniteMaxTensors tensors) plus one finalize block.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda_glue.h"

namespace strobe::ops {
namespace detail {
void nonfinite_check_args(at::TensorList tensors);
}  // namespace detail

namespace {

std::tuple<at::Tensor, at::Tensor> nonfinite_check_cuda(at::TensorList tensors,
                                                        bool compute_norm) {
  detail::nonfinite_check_args(tensors);
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  // A flag and a sum of squares do not care about element order: dense tensors (channels_last
  // included) are read in place; only strided views are copied (alive until enqueued).
  std::vector<at::Tensor> keep;
  std::vector<cuda::NonfiniteTensor> meta;
  meta.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    const at::Tensor c = t.is_non_overlapping_and_dense() ? t : keep.emplace_back(t.contiguous());
    meta.push_back({c.data_ptr(), c.numel(), detail::kernel_dtype(c, "nonfinite_check (CUDA)", "tensor", {cuda::DType::kFloat32, cuda::DType::kBFloat16, cuda::DType::kFloat16, cuda::DType::kFloat64})});
  }
  const auto fopt = tensors[0].options().dtype(at::kFloat);
  const int64_t parts = cuda::nonfinite_num_partials(meta.data(), static_cast<int>(meta.size()));
  const at::Tensor partials = at::empty({2 * std::max<int64_t>(parts, 1)}, fopt.dtype(at::kInt));
  int* partial_found = partials.data_ptr<int>();
  at::Tensor found = at::empty({}, fopt);
  at::Tensor norm = compute_norm ? at::empty({}, fopt) : at::Tensor();
  C10_CUDA_CHECK(cuda::nonfinite_check(
      meta.data(), static_cast<int>(meta.size()), reinterpret_cast<float*>(partial_found + parts),
      partial_found, found.data_ptr<float>(), compute_norm ? norm.data_ptr<float>() : nullptr,
      detail::current_stream()));
  return {found, norm};
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("nonfinite_check", &strobe::ops::nonfinite_check_cuda);
}
