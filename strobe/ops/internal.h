// Helpers shared by the op bindings (not installed, not part of the public API).
#pragma once

#include <cstdint>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace strobe::ops::detail {

// Reduction codes of the internal giou ops (ATen's at::Reduction values).
enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };
// Layout codes, equal to cuda::GiouLayout.
enum Layout : int64_t { kPadded = 0, kPackedTargets = 1, kPacked = 2 };

inline int64_t parse_reduction(std::string_view r) {
  if (r == "mean") return kMean;
  if (r == "sum") return kSum;
  if (r == "none") return kNone;
  TORCH_CHECK(false, "giou_loss: reduction must be 'none', 'mean' or 'sum', got '", r, "'");
}

inline void check_same_device(const at::Tensor& t, const at::Device& d, const char* op,
                              const char* what) {
  TORCH_CHECK(t.device() == d, op, ": ", what, " is on ", t.device(), " but expected ", d);
}

}  // namespace strobe::ops::detail
