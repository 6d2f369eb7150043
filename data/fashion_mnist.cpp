// fashion_mnist: Fashion-MNIST from its IDX files (Debian's dataset-fashion-mnist installs them under
// /usr/share/datasets/fashion-mnist). Train = the first 60000 - val_size training images, val = the
// rest, test = t10k. Images are normalized with the training set's mean and std; `augment: true`
// adds a random horizontal flip drawn from the per-sample generator.
#include <filesystem>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/idx_file.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/data_error.h"
#include "strobe/data/dataset.h"

namespace strobe::data {
namespace {

constexpr double kMean = 0.2860, kStd = 0.3530;

class IdxImageDataset : public Dataset {
 public:
  IdxImageDataset(torch::Tensor images, torch::Tensor labels, bool augment)
      : images_(std::move(images)), labels_(std::move(labels)), augment_(augment) {}
  int64_t size() const override { return images_.size(0); }
  Sample get(int64_t index, at::Generator& gen) const override {
    auto img = images_[index].to(torch::kFloat32).div_(255.0).sub_(kMean).div_(kStd).unsqueeze(0);
    if (augment_ && torch::rand({1}, gen).item<float>() < 0.5f) img = img.flip({2});
    return {{"image", img}, {"label", labels_[index].to(torch::kInt64)}};
  }

 private:
  torch::Tensor images_, labels_;
  bool augment_;
};

std::string find_file(const std::filesystem::path& root, const std::string& stem) {
  for (const char* ext : {".gz", ""}) {
    auto p = root / (stem + ext);
    if (std::filesystem::exists(p)) return p.string();
  }
  throw DataError(fmt::format("{}: missing (looked for {}.gz and {} in {})", (root / stem).string(), stem, stem,
                                       root.string()));
}

std::pair<torch::Tensor, torch::Tensor> load_split(const std::filesystem::path& root, const std::string& prefix) {
  std::string img_path = find_file(root, prefix + "-images-idx3-ubyte");
  std::string lbl_path = find_file(root, prefix + "-labels-idx1-ubyte");
  auto images = read_idx_file(img_path);
  auto labels = read_idx_file(lbl_path);
  if (images.dim() != 3) throw DataError(fmt::format("{}: expected [N, rows, cols] images", img_path));
  if (labels.dim() != 1 || labels.size(0) != images.size(0))
    throw DataError(fmt::format("{}: {} labels for {} images in {}", lbl_path, labels.size(0), images.size(0), img_path));
  if (labels.max().item<int64_t>() > 9) throw DataError(fmt::format("{}: label above 9", lbl_path));
  return {images, labels};
}

std::shared_ptr<DataModule> make_fashion_mnist(config::Section& cfg, const DataContext& ctx) {
  std::string root = cfg.get_string("root", "/usr/share/datasets/fashion-mnist");
  int64_t val_size = cfg.get_int("val_size", 5000, 0, 59999);
  bool augment = cfg.get_bool("augment", false);
  LoaderOptions opt = read_loader_options(cfg, ctx, 128);
  cfg.finish();
  if (!std::filesystem::is_directory(root))
    cfg.fail("root", fmt::format("'{}' is not a directory (Debian: apt-get install dataset-fashion-mnist)", root));
  auto [train_img, train_lbl] = load_split(root, "train");
  auto [test_img, test_lbl] = load_split(root, "t10k");
  int64_t n_train = train_img.size(0) - val_size;
  auto train = std::make_shared<IdxImageDataset>(train_img.narrow(0, 0, n_train), train_lbl.narrow(0, 0, n_train), augment);
  std::shared_ptr<Dataset> val;
  if (val_size > 0)
    val = std::make_shared<IdxImageDataset>(train_img.narrow(0, n_train, val_size), train_lbl.narrow(0, n_train, val_size), false);
  auto test = std::make_shared<IdxImageDataset>(test_img, test_lbl, false);
  auto dm = std::make_shared<DatasetDataModule>(train, val, test, stack_collate, opt);
  DataInfo info{10, "", 1, "", train_img.size(1), ""};
  info.batch_keys = {"image", "label"};
  dm->set_info(info);
  return dm;
}

STROBE_REGISTER(data_registry(), "fashion_mnist", make_fashion_mnist);

}  // namespace
}  // namespace strobe::data
