// synthetic_boxes renders exactly what it rendered before the word-wide noise store (2026-11-23):
// checksums of fixed batches recorded with the previous scalar renderer. Sizes 30 (900 pixels, a
// partial last noise word) and 64.
#include <cstdio>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tests/data/data_test_util.h"

namespace strobe {
namespace {

uint64_t checksum(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (int64_t i = 0; i < c.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

TEST(SyntheticBoxes, RenderingIsUnchanged) {
  const std::vector<std::pair<int, uint64_t>> golden = {{30, 3397204790647347480ull}, {64, 17204343786769992632ull}};
  for (const auto& [size, want] : golden) {
    auto dm = testing::build_data("{name: synthetic_boxes, image_size: " + std::to_string(size) +
                                  ", num_samples: 32, batch_size: 32, num_workers: 0, shuffle: false}");
    auto b = dm->train_loader()->make_batch(1, 0);
    const uint64_t got = checksum(b.at("image")) ^ (checksum(b.at("boxes")) * 31);
    std::printf("image_size %d checksum %llu\n", size, static_cast<unsigned long long>(got));
    EXPECT_EQ(got, want) << "image_size " << size;
  }
}

}  // namespace
}  // namespace strobe
