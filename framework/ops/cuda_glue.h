// Torch-side helpers of the CUDA glue (*_cuda.cpp): dtype mapping, stream, error checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "framework/ops/cuda/launchers.h"

namespace strobe::ops::detail {

inline bool to_kernel_dtype(at::ScalarType s, cuda::DType* out) {
  switch (s) {
    case at::kFloat: *out = cuda::DType::kFloat32; return true;
    case at::kHalf: *out = cuda::DType::kFloat16; return true;
    case at::kBFloat16: *out = cuda::DType::kBFloat16; return true;
    case at::kDouble: *out = cuda::DType::kFloat64; return true;
    default: return false;
  }
}

inline cuda::DType kernel_dtype(const at::Tensor& t, const char* op, const char* what) {
  cuda::DType d{};
  TORCH_CHECK(to_kernel_dtype(t.scalar_type(), &d), op, ": ", what,
              " must be float32, float16, bfloat16 or float64, got ", t.scalar_type());
  return d;
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace strobe::ops::detail
