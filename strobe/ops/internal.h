// Helpers shared by the op bindings (not installed, not part of the public API).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "strobe/ops/cuda/giou_layout.h"

namespace strobe::ops::detail {

// The reduction codes the internal ops' schemas carry (ATen's at::Reduction values): giou_loss and
// cross_entropy.
enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };
// The GIoU layout codes the schemas carry: cuda::GiouLayout's values, named once there.
inline constexpr int64_t kPadded = static_cast<int64_t>(cuda::GiouLayout::kPadded);
inline constexpr int64_t kPackedTargets = static_cast<int64_t>(cuda::GiouLayout::kPackedTargets);
inline constexpr int64_t kPacked = static_cast<int64_t>(cuda::GiouLayout::kPacked);

// A user's reduction word as its code; `op` names the op in the error.
inline int64_t parse_reduction(std::string_view r, const char* op) {
  if (r == "mean") return kMean;
  if (r == "sum") return kSum;
  if (r == "none") return kNone;
  TORCH_CHECK(false, op, ": reduction must be 'none', 'mean' or 'sum', got '", r, "'");
}

// The GIoU loss's input checks, shared by its CPU, CUDA and meta kernels (giou_loss.cpp).
void giou_check_inputs(const at::Tensor& pred, const at::Tensor& target, const std::optional<at::Tensor>& offsets,
                       int64_t layout);

// fp8_quantize's input checks (x, the float8 dtype, a given amax), shared by its CPU, CUDA and meta
// kernels (fp8.cpp).
void fp8_check_input(const at::Tensor& x, at::ScalarType dtype, const std::optional<at::Tensor>& amax);
// max |x| in fp32, 0-dim: NaN when x holds a NaN, 0 for an empty x. The amax of a float8 quantization,
// on the CPU (fp8_quantize's, and swiglu's outputs' for fp8_linear_swiglu).
at::Tensor fp8_amax(const at::Tensor& x);

// Whether an optional tensor argument (a schema's `Tensor?`) was given.
inline bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

inline void check_same_device(const at::Tensor& t, const at::Device& d, const char* op,
                              const char* what) {
  TORCH_CHECK(t.device() == d, op, ": ", what, " is on ", t.device(), " but expected ", d);
}

}  // namespace strobe::ops::detail
