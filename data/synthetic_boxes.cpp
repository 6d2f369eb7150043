// synthetic_boxes: the seed's face-detection data (custom-cuda-giou-kernel.txt), rendered so that a
// detector can learn it. Per sample: n = min(floor(|N(0, 3)|), max_boxes) boxes (mostly <= 5, rarely
// dozens); each box: size uniform in [1, S) per axis, top-left uniform in [0, S - 1), bottom-right
// clamped to S - 1 (the seed's distribution); so y2 >= 1 and every real box is valid under the
// padding rule (y2 > 0). The image (uint8, 1 x S x S) is dim noise in [0, 64) with each box's interior
// brightened by 48 and its 1-px outline drawn at 255. Boxes are sorted by (y1, x1, y2, x2), giving
// each prediction slot a well-defined target. Targets: "boxes" float [max_boxes, 4] (x1, y1, x2, y2)
// in pixels, zero-padded; "num_boxes" int64.
#include <algorithm>
#include <array>
#include <cstring>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/synthetic_rng.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/dataset.h"

namespace strobe::data {
namespace {

class SyntheticBoxes : public Dataset {
 public:
  SyntheticBoxes(int64_t size, int64_t image_size, int64_t max_boxes, uint64_t salt)
      : size_(size), s_(image_size), max_boxes_(max_boxes), salt_(salt) {}
  int64_t size() const override { return size_; }

  Sample get(int64_t /*index*/, at::Generator& gen) const override {
    SampleRng rng(gen, salt_);
    const auto n = std::min<int64_t>({static_cast<int64_t>(std::floor(std::abs(rng.normal() * 3.0))), 255, max_boxes_});
    std::vector<std::array<int64_t, 4>> boxes(n);
    for (auto& b : boxes) {
      const int64_t w = rng.uniform_int(1, s_), h = rng.uniform_int(1, s_);
      const int64_t x1 = rng.uniform_int(0, s_ - 1), y1 = rng.uniform_int(0, s_ - 1);
      b = {x1, y1, std::min(x1 + w, s_ - 1), std::min(y1 + h, s_ - 1)};
    }
    std::sort(boxes.begin(), boxes.end(), [](const auto& a, const auto& b) {
      return std::tie(a[1], a[0], a[3], a[2]) < std::tie(b[1], b[0], b[3], b[2]);
    });

    auto image = torch::empty({1, s_, s_}, torch::kUInt8);
    uint8_t* px = image.data_ptr<uint8_t>();
    // Noise: byte j of each 64-bit draw (low byte first) masked to [0, 64), eight pixels per draw;
    // whole words go in with one masked 8-byte store (little-endian: the same bytes as the scalar
    // tail loop, which the last partial word still takes).
    static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the word-wide noise store assumes little-endian");
    const int64_t total = s_ * s_;
    int64_t i = 0;
    for (; i + 8 <= total; i += 8) {
      const uint64_t r = rng.next() & 0x3F3F3F3F3F3F3F3Full;
      std::memcpy(px + i, &r, sizeof(r));
    }
    if (i < total) {
      const uint64_t r = rng.next();
      for (int64_t j = 0; i + j < total; ++j) px[i + j] = static_cast<uint8_t>((r >> (8 * j)) & 63);
    }
    for (const auto& b : boxes) {
      const int64_t x1 = b[0], y1 = b[1], x2 = b[2], y2 = b[3];
      for (int64_t y = y1; y <= y2; ++y) {
        uint8_t* row = px + y * s_;
        if (y == y1 || y == y2) {
          std::fill(row + x1, row + x2 + 1, uint8_t{255});
          continue;
        }
        row[x1] = row[x2] = 255;
        for (int64_t x = x1 + 1; x < x2; ++x) row[x] = static_cast<uint8_t>(std::min(255, row[x] + 48));
      }
    }
    auto target = torch::zeros({max_boxes_, 4}, torch::kFloat32);
    auto* t = target.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int k = 0; k < 4; ++k) t[i * 4 + k] = static_cast<float>(boxes[i][k]);
    return {{"image", image}, {"boxes", target}, {"num_boxes", torch::tensor(n, torch::kInt64)}};
  }

 private:
  int64_t size_, s_, max_boxes_;
  uint64_t salt_;
};

std::shared_ptr<DataModule> make_synthetic_boxes(config::Section& cfg, const DataContext& ctx) {
  const int64_t image_size = cfg.get_int("image_size", 256, 16, 8192);
  const int64_t max_boxes = cfg.get_int("max_boxes", 256, 1);
  const int64_t num_samples = cfg.get_int("num_samples", 1024 * 100, 1);
  const int64_t num_val = cfg.get_int("num_val_samples", 1024, 0);
  LoaderOptions opt = read_loader_options(cfg, ctx, 1024);
  cfg.finish();
  auto train = std::make_shared<SyntheticBoxes>(num_samples, image_size, max_boxes, 0);
  std::shared_ptr<Dataset> val;
  if (num_val > 0) val = std::make_shared<SyntheticBoxes>(num_val, image_size, max_boxes, 1);
  auto test = std::make_shared<SyntheticBoxes>(std::max<int64_t>(num_val, 1), image_size, max_boxes, 2);
  auto dm = std::make_shared<DatasetDataModule>(train, val, test, stack_collate, opt);
  DataInfo info;
  info.channels = 1;
  info.image_size = image_size, info.image_size_key = "image_size";
  info.batch_keys = {"image", "boxes", "num_boxes"};
  dm->set_info(info);
  return dm;
}

STROBE_REGISTER(data_registry(), "synthetic_boxes", make_synthetic_boxes);

}  // namespace
}  // namespace strobe::data
