// The CUDA trainer tests skip on a machine without a visible GPU (their own binary; every test here
// builds with or without our CUDA kernels).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#define SKIP_WITHOUT_CUDA_DEVICE() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: CUDA trainer test skipped"
