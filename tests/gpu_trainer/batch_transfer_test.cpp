// The copy stream behind the trainer's host-to-device batch copies (strobe/core/device_transfer.h):
// the copies run on a side stream, and the compute stream may only read the batch after them.
#include <gtest/gtest.h>

#include <ATen/cuda/Sleep.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include "strobe/core/device_transfer.h"
#include "strobe/logging/device_readback.h"
#include "tests/gpu_trainer/cuda_skip.h"

using namespace strobe;

TEST(BatchTransferCuda, CopiesOnASideStreamAndTheComputeStreamWaitsForThem) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const torch::Device cuda(torch::kCUDA, 0);
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  BatchTransfer transfer;
  // 256 MB of a known pattern in pinned memory; its exact sum is known on the host.
  auto host = torch::arange(64 * 1024 * 1024, torch::kInt32).remainder(1009).pin_memory();
  const int64_t expected = host.sum(torch::kInt64).item<int64_t>();
  auto copy = [&] {
    Batch b;
    b.tensors["x"] = host.to(cuda, /*non_blocking=*/true);
    return b;
  };
  Batch first = transfer(cuda, copy);
  ASSERT_TRUE(transfer.stream().has_value());
  EXPECT_NE(transfer.stream()->id(), impl.getStream(cuda).id()) << "the copy ran on the compute stream";
  EXPECT_EQ(first.at("x").sum(torch::kInt64).item<int64_t>(), expected);
  for (int round = 0; round < 3; ++round) {
    torch::cuda::synchronize();
    // Keep the copy stream busy so that its copy finishes long after this thread moves on: if the
    // compute stream did not wait for it, the sum below would read memory not yet written.
    auto a = torch::randn({4096, 4096}, torch::TensorOptions(cuda));
    {
      c10::StreamGuard busy(*transfer.stream());
      for (int i = 0; i < 20; ++i) a = torch::mm(a, a).clamp_(-1, 1);
    }
    Batch b = transfer(cuda, copy);
    EXPECT_TRUE(b.at("x").is_cuda());
    EXPECT_EQ(b.at("x").sum(torch::kInt64).item<int64_t>(), expected) << "round " << round;
  }
}

TEST(BatchTransfer, CpuDevicesTransferInPlace) {
  BatchTransfer transfer;
  Batch b = transfer(torch::kCPU, [] {
    Batch x;
    x.tensors["x"] = torch::ones({3});
    return x;
  });
  EXPECT_FALSE(transfer.stream().has_value());
  EXPECT_EQ(b.at("x").sum().item<float>(), 3.f);
}

// DeviceReadback: start() returns before the copied value exists (a spin kernel holds the stream for
// about 0.1 s before the value is written), ready() says so without blocking, and wait() gives the
// value once the stream reaches the copy. A start() that waited for the device fails here.
TEST(DeviceReadbackCuda, StartsWithoutWaitingAndReadsTheValueOnceTheStreamGetsThere) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const torch::Device cuda(torch::kCUDA, 0);
  strobe::DeviceReadback r;
  // The first start() allocates the pinned buffer (cudaHostAlloc may wait for the device); the
  // rounds below reuse it, as a ring of readbacks does.
  r.start(torch::zeros({}, torch::TensorOptions(cuda).dtype(torch::kInt32)));
  r.wait();
  const void* buffer = r.host().data_ptr();
  for (int round = 0; round < 3; ++round) {
    torch::cuda::synchronize();
    at::cuda::sleep(200'000'000);  // ~0.1 s of spinning on the current stream
    auto value = torch::full({}, round + 1, torch::TensorOptions(cuda).dtype(torch::kInt32));
    r.start(value);
    const bool landed_at_once = r.ready();
    EXPECT_FALSE(landed_at_once) << "start() waited for the device";
    EXPECT_TRUE(r.asynchronous());
    EXPECT_EQ(r.host().data_ptr(), buffer);
    EXPECT_EQ(r.wait().item<int>(), round + 1);
    EXPECT_TRUE(r.ready());
    EXPECT_TRUE(r.host().is_pinned());
  }
}
