// Internal to max_pool.cpp and max_pool_cuda.cpp: the resolved pooling arguments and the checks both
// devices share (not part of the public API; see ops.h for strobe::ops::max_pool2d).
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace strobe::ops::detail {

struct PoolArgs {
  int64_t kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0;
};

// kernel_size / stride / padding as one or two ints (an empty stride means kernel_size); checks
// kernel_h * kernel_w <= 256 and 0 <= padding <= kernel / 2 (as PyTorch).
PoolArgs pool_args(at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding);
// Checks x ([N, C, H, W], floating) against the window and returns the output shape (floor mode).
std::vector<c10::SymInt> pool_check(const at::Tensor& x, const PoolArgs& a);
// Whether the op works in channels-last NHWC for x (its suggested memory format), else NCHW.
bool pool_channels_last(const at::Tensor& x);

}  // namespace strobe::ops::detail
