// synthetic_images: a learnable image classification set made on the fly. Each class has a fixed
// template (drawn from the data seed); a sample is its class template plus Gaussian noise drawn
// from the per-sample generator. Val/test use disjoint index ranges of the same distribution.
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/datamodule.h"
#include "strobe/data/dataset.h"

namespace strobe::data {
namespace {

class SyntheticImages : public Dataset {
 public:
  SyntheticImages(torch::Tensor templates, int64_t size, int64_t offset, double noise)
      : templates_(std::move(templates)), size_(size), offset_(offset), noise_(noise) {}
  int64_t size() const override { return size_; }
  Sample get(int64_t index, at::Generator& gen) const override {
    int64_t k = templates_.size(0);
    int64_t label = (index + offset_) % k;
    // noise x N(0, 1) + template, in place (the same bits as template + noise * randn, one tensor).
    auto img = torch::randn(templates_[label].sizes(), gen).mul_(noise_).add_(templates_[label]);
    return {{"image", img}, {"label", torch::tensor(label, torch::kInt64)}};
  }

 private:
  torch::Tensor templates_;
  int64_t size_, offset_;
  double noise_;
};

std::shared_ptr<DataModule> make_synthetic_images(config::Section& cfg, const DataContext& ctx) {
  int64_t image_size = cfg.get_int("image_size", 32, 1, 4096);
  int64_t channels = cfg.get_int("channels", 3, 1, 64);
  int64_t num_classes = cfg.get_int("num_classes", 10, 1, 100000);
  int64_t num_samples = cfg.get_int("num_samples", 1024, 1);
  int64_t num_val = cfg.get_int("num_val_samples", 256, 0);
  double noise = cfg.get_double("noise", 1.0, 0.0);
  LoaderOptions opt = read_loader_options(cfg, ctx, 32);
  cfg.finish();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ctx.seed + 0x5EED);
  auto templates = torch::randn({num_classes, channels, image_size, image_size}, gen);
  auto train = std::make_shared<SyntheticImages>(templates, num_samples, 0, noise);
  std::shared_ptr<Dataset> val;
  if (num_val > 0) val = std::make_shared<SyntheticImages>(templates, num_val, 7, noise);
  auto test = std::make_shared<SyntheticImages>(templates, std::max<int64_t>(num_val, 1), 13, noise);
  auto dm = std::make_shared<DatasetDataModule>(train, val, test, stack_collate, opt);
  DataInfo info{num_classes, "num_classes", channels, "channels", image_size, "image_size"};
  info.batch_keys = {"image", "label"};
  dm->set_info(info);
  return dm;
}

STROBE_REGISTER(data_registry(), "synthetic_images", make_synthetic_images);

}  // namespace
}  // namespace strobe::data
