// The copy stream behind the trainer's host-to-device batch copies (strobe/core/device_transfer.h):
// the copies run on a side stream, and the compute stream may only read the batch after them.
#include <gtest/gtest.h>

#include <ATen/cuda/Sleep.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <mutex>
#include <set>

#include "strobe/core/device_transfer.h"
#include "strobe/data/loader.h"
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

// A loader that pins its batches (a GPU run) has stack_collate stack straight into pinned memory
// (collate_pins(), strobe/data/dataset.h): the batch is pinned without the loader's second copy, and
// equal to the pageable batch of the same epoch.
TEST(BatchTransferCuda, APinningLoaderStacksItsBatchesStraightIntoPinnedMemory) {
  SKIP_WITHOUT_CUDA_DEVICE();
  struct Noise : data::Dataset {
    int64_t size() const override { return 12; }
    Sample get(int64_t index, at::Generator& gen) const override {
      EXPECT_EQ(data::collate_pins(), false) << "only the collate runs under the hint";
      return {{"x", torch::randn({3, 32, 32}, gen) + static_cast<double>(index)}, {"i", torch::tensor(index)}};
    }
  };
  int calls = 0, pinned_hint = 0;
  std::mutex mu;
  std::set<const void*> stacked;  // where the collate's x of each batch lies
  data::CollateFn collate = [&](std::vector<Sample>& s) {
    Batch b = data::stack_collate(s);
    std::lock_guard<std::mutex> lock(mu);
    ++calls;
    pinned_hint += data::collate_pins();
    stacked.insert(b.at("x").data_ptr());
    return b;
  };
  auto batches = [&](bool pin) {
    data::LoaderOptions o;
    o.batch_size = 4;
    o.num_workers = 2;
    o.seed = 5;
    o.pin_memory = pin;
    data::DataLoader loader(std::make_shared<Noise>(), collate, o);
    loader.start(1);
    std::vector<Batch> out;
    while (auto b = loader.next()) out.push_back(*b);
    return out;
  };
  const auto pinned = batches(true);
  EXPECT_EQ(pinned_hint, 3);
  const auto pageable = batches(false);
  EXPECT_EQ(calls, 6);
  EXPECT_EQ(pinned_hint, 3) << "the hint is off for a loader that does not pin";
  ASSERT_EQ(pinned.size(), 3u);
  for (size_t k = 0; k < pinned.size(); ++k) {
    for (const char* key : {"x", "i"}) {
      EXPECT_TRUE(pinned[k].at(key).is_pinned()) << key;
      EXPECT_FALSE(pageable[k].at(key).is_pinned()) << key;
      EXPECT_TRUE(torch::equal(pinned[k].at(key), pageable[k].at(key))) << key << " batch " << k;
    }
    // The pinned batch is the collate's own tensor, not a copy the loader made.
    EXPECT_EQ(stacked.count(pinned[k].at("x").data_ptr()), 1u) << "batch " << k;
  }
}
