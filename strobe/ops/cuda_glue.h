// Torch-side helpers of the CUDA glue (*_cuda.cpp): dtype mapping, stream, error checks.
#pragma once

#include <initializer_list>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "strobe/ops/cuda/launchers.h"

namespace strobe::ops::detail {

inline bool to_kernel_dtype(at::ScalarType s, cuda::DType* out) {
  switch (s) {
    case at::kFloat: *out = cuda::DType::kFloat32; return true;
    case at::kHalf: *out = cuda::DType::kFloat16; return true;
    case at::kBFloat16: *out = cuda::DType::kBFloat16; return true;
    case at::kDouble: *out = cuda::DType::kFloat64; return true;
    case at::kByte: *out = cuda::DType::kUInt8; return true;
    default: return false;
  }
}

// The kernel dtype of `s` when it is one of `allowed`; otherwise an error naming the op, the tensor
// and the allowed types in the order given ("x must be float32, bfloat16 or float16, got Double").
inline cuda::DType kernel_dtype(at::ScalarType s, const char* op, const char* what,
                                std::initializer_list<cuda::DType> allowed) {
  cuda::DType d{};
  const bool known = to_kernel_dtype(s, &d);
  for (cuda::DType a : allowed)
    if (known && a == d) return d;
  std::string names;
  size_t i = 0;
  for (cuda::DType a : allowed) {
    names += (i == 0 ? "" : i + 1 == allowed.size() ? " or " : ", ");
    names += cuda::dtype_name(a);
    ++i;
  }
  TORCH_CHECK(false, op, ": ", what, " must be ", names, ", got ", s);
}
inline cuda::DType kernel_dtype(const at::Tensor& t, const char* op, const char* what,
                                std::initializer_list<cuda::DType> allowed) {
  return kernel_dtype(t.scalar_type(), op, what, allowed);
}

// The floating types most kernels take, in the order their messages list them.
constexpr std::initializer_list<cuda::DType> kFloatingTypes = {cuda::DType::kFloat32, cuda::DType::kBFloat16,
                                                               cuda::DType::kFloat16};

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace strobe::ops::detail
