// The element types our CUDA kernels read and write: one enum for every launcher (no torch header).
// The torch glue maps at::ScalarType onto it with detail::kernel_dtype (strobe/ops/cuda_glue.h),
// which names the types each op allows; the device side converts with strobe/ops/cuda/common.cuh.
#pragma once

#include <cstdint>

namespace strobe::ops::cuda {

enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3, kUInt8 = 4 };

// "float32", "float16", ... as users see them in messages.
inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kUInt8: return "uint8";
  }
  return "?";
}

}  // namespace strobe::ops::cuda
