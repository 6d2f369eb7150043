// DeviceReadback (strobe/logging/device_readback.h) on the CPU: the host copy has the value's
// shape, dtype and values, is independent of the value afterwards, and reuses its buffer.
// tests/gpu_trainer/batch_transfer_test.cpp checks the asynchronous CUDA side.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "strobe/logging/device_readback.h"

namespace strobe {
namespace {

TEST(DeviceReadback, CpuCopiesAreReadyAtOnceAndOwnTheirValues) {
  DeviceReadback r;
  EXPECT_FALSE(r.started());
  auto v = torch::arange(6, torch::kInt32).reshape({2, 3});
  r.start(v);
  EXPECT_TRUE(r.started());
  EXPECT_FALSE(r.asynchronous());
  EXPECT_TRUE(r.ready());
  EXPECT_EQ(r.host().scalar_type(), torch::kInt32);
  EXPECT_EQ(r.host().sizes(), v.sizes());
  v.add_(100);  // the copy is the value at start()
  EXPECT_TRUE(torch::equal(r.wait(), torch::arange(6, torch::kInt32).reshape({2, 3})));

  const void* storage = r.host().data_ptr();
  r.start(torch::full({}, 7, torch::kInt32));  // smaller: the same buffer
  EXPECT_EQ(r.host().data_ptr(), storage);
  EXPECT_EQ(r.host().dim(), 0);
  EXPECT_EQ(r.wait().item<int>(), 7);

  r.start(torch::tensor({1.5f, -2.f}));  // another dtype: a new buffer
  EXPECT_EQ(r.host().scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(r.wait(), torch::tensor({1.5f, -2.f})));
}

}  // namespace
}  // namespace strobe
