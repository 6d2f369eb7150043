// Shared by the CUDA kernel tests (tests/gpu_*): skipping without a GPU or without our CUDA kernels,
// a NaN-poisoned caching allocator (an output element a kernel never writes then fails the check),
// and the relative error against a float64 reference (NaN never passes).
#pragma once

#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/ops/op_test_util.h"

#define SKIP_WITHOUT_CUDA()                                                              \
  do {                                                                                   \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";          \
    if (!strobe::ops::built_with_cuda()) GTEST_SKIP() << "strobe_ops built without CUDA"; \
  } while (0)

namespace strobe::testing {

inline const torch::Device kCuda("cuda");

// Fill and free a large block so the next allocations reuse NaN-filled memory.
inline void poison_allocator(int64_t floats = 64 << 20) {
  torch::Tensor junk = torch::full({floats}, NAN, torch::TensorOptions(kCuda).dtype(torch::kFloat));
  junk.reset();
}

}  // namespace strobe::testing
