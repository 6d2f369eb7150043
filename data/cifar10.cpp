// cifar10: CIFAR-10's binary version (https://www.cs.toronto.edu/~kriz/cifar.html) from `root`, the
// folder holding data_batch_{1..5}.bin and test_batch.bin (or its cifar-10-batches-bin subfolder).
// Each record: 1 label byte (0..9) then 3072 bytes of 32x32 RGB, channel-major. Train = the five data
// batches minus the last val_size images, val = those, test = test_batch. Images are normalized with
// the usual per-channel CIFAR-10 mean/std; `augment: true` adds a random crop (pad 4) and horizontal
// flip drawn from the per-sample generator. A missing file, a size that is not a whole number of
// records, or a label above 9 is one error naming the file.
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/synthetic_rng.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/data_error.h"
#include "strobe/data/dataset.h"

namespace strobe::data {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kRecord = 1 + 3 * 32 * 32;

struct Split {
  torch::Tensor images;  // uint8 [N, 3, 32, 32]
  torch::Tensor labels;  // int64 [N]
};

Split read_batches(const std::vector<fs::path>& files) {
  std::vector<torch::Tensor> images, labels;
  for (const auto& f : files) {
    require_regular_file(f.string());
    std::ifstream in(f, std::ios::binary | std::ios::ate);
    if (!in) throw DataError(fmt::format("{}: missing or unreadable (CIFAR-10 binary batch)", f.string()));
    const int64_t size = in.tellg();
    if (size == 0 || size % kRecord != 0)
      throw DataError(fmt::format("{}: {} bytes is not a whole number of {}-byte CIFAR-10 records (truncated or not CIFAR-10 binary)",
                                           f.string(), size, kRecord));
    in.seekg(0);
    auto raw = torch::empty({size / kRecord, kRecord}, torch::kUInt8);
    if (!in.read(reinterpret_cast<char*>(raw.data_ptr<uint8_t>()), size))
      throw DataError(fmt::format("{}: read failed", f.string()));
    auto lbl = raw.select(1, 0).to(torch::kInt64);
    if (lbl.max().item<int64_t>() > 9) throw DataError(fmt::format("{}: label above 9 (not CIFAR-10 binary)", f.string()));
    labels.push_back(lbl);
    images.push_back(raw.narrow(1, 1, kRecord - 1).reshape({-1, 3, 32, 32}));
  }
  return {torch::cat(images), torch::cat(labels)};
}

class Cifar10 : public Dataset {
 public:
  Cifar10(Split split, bool augment) : s_(std::move(split)), augment_(augment) {}
  int64_t size() const override { return s_.images.size(0); }
  Sample get(int64_t index, at::Generator& gen) const override {
    static const auto mean = torch::tensor({0.4914f, 0.4822f, 0.4465f}).view({3, 1, 1});
    static const auto std = torch::tensor({0.2470f, 0.2435f, 0.2616f}).view({3, 1, 1});
    auto img = s_.images[index].to(torch::kFloat32).div_(255.0).sub_(mean).div_(std);
    if (augment_) {
      SampleRng rng(gen, 0);
      const int64_t dy = rng.uniform_int(0, 9), dx = rng.uniform_int(0, 9);
      img = torch::constant_pad_nd(img, {4, 4, 4, 4}, 0.0).narrow(1, dy, 32).narrow(2, dx, 32).contiguous();
      if (rng.uniform() < 0.5) img = img.flip({2});
    }
    return {{"image", img}, {"label", s_.labels[index]}};
  }

 private:
  Split s_;
  bool augment_;
};

std::shared_ptr<DataModule> make_cifar10(config::Section& cfg, const DataContext& ctx) {
  std::string root = cfg.get_string("root", "/usr/share/datasets/cifar10");
  const int64_t val_size = cfg.get_int("val_size", 5000, 0, 49999);
  const bool augment = cfg.get_bool("augment", false);
  LoaderOptions opt = read_loader_options(cfg, ctx, 128);
  cfg.finish();
  if (fs::is_directory(fs::path(root) / "cifar-10-batches-bin")) root = (fs::path(root) / "cifar-10-batches-bin").string();
  if (!fs::is_directory(root)) cfg.fail("root", fmt::format("'{}' is not a directory (expected CIFAR-10's binary batches)", root));
  std::vector<fs::path> train_files;
  for (int i = 1; i <= 5; ++i) train_files.push_back(fs::path(root) / fmt::format("data_batch_{}.bin", i));
  Split all = read_batches(train_files), test = read_batches({fs::path(root) / "test_batch.bin"});
  const int64_t n = all.images.size(0);
  if (val_size >= n) cfg.fail("val_size", fmt::format("must be below the {} training images", n));
  auto train = std::make_shared<Cifar10>(Split{all.images.narrow(0, 0, n - val_size), all.labels.narrow(0, 0, n - val_size)}, augment);
  std::shared_ptr<Dataset> val;
  if (val_size > 0)
    val = std::make_shared<Cifar10>(Split{all.images.narrow(0, n - val_size, val_size), all.labels.narrow(0, n - val_size, val_size)}, false);
  auto dm = std::make_shared<DatasetDataModule>(train, val, std::make_shared<Cifar10>(test, false), stack_collate, opt);
  DataInfo info{10, "", 3, "", 32, ""};
  info.batch_keys = {"image", "label"};
  dm->set_info(info);
  return dm;
}

STROBE_REGISTER(data_registry(), "cifar10", make_cifar10);

}  // namespace
}  // namespace strobe::data
