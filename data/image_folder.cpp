// image_folder: see image_folder.h for the listing and docs/DATA.md for the transforms. A sample is
// "image" uint8 [channels, image_size, image_size] and "label" int64; the data module normalizes
// the batch to float on the device, after the host-to-device copy (on_after_batch_transfer). Train: the
// configured train_transform (+ horizontal flip); val/test: resize + center crop. Each file is read,
// its header parsed, the crop box drawn from the per-sample generator, then decoded (downscaled in
// the DCT domain when the box is at least twice the output size) and resampled in one pass.
#include "data/image_folder.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/image_codec.h"
#include "data/image_transforms.h"
#include "data/synthetic_rng.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/dataset.h"

namespace strobe::data {

namespace fs = std::filesystem;

ImageFolderListing list_image_folder(const std::string& root, const BadSampleLog& log) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) throw DataError(fmt::format("{}: not a directory (expected root/<class>/<image>)", root));
  ImageFolderListing out;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.is_directory(ec)) out.classes.push_back(e.path().filename().string());
  if (ec) throw DataError(fmt::format("{}: cannot list ({})", root, ec.message()));
  std::sort(out.classes.begin(), out.classes.end());
  if (out.classes.empty()) throw DataError(fmt::format("{}: no class folder (expected root/<class>/<image>)", root));
  for (size_t c = 0; c < out.classes.size(); ++c) {
    const fs::path dir = fs::path(root) / out.classes[c];
    std::vector<std::pair<std::string, std::string>> files;  // (folder, name): torchvision's sorted(os.walk)
    for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (it->is_regular_file(ec)) files.emplace_back(it->path().parent_path().string(), it->path().filename().string());
    }
    if (ec) throw DataError(fmt::format("{}: cannot list ({})", dir.string(), ec.message()));
    std::sort(files.begin(), files.end());
    size_t added = 0;
    for (const auto& [folder, name] : files) {
      const std::string path = (fs::path(folder) / name).string();
      if (!has_image_extension(name)) {
        log.bad(path, fmt::format("{}: unknown extension (image folders hold .jpg, .jpeg and .png files)", path));
        continue;
      }
      out.samples.emplace_back(path, static_cast<int64_t>(c));
      ++added;
    }
    if (added == 0) log.bad(dir.string(), fmt::format("{}: class folder '{}' holds no image", dir.string(), out.classes[c]));
  }
  return out;
}

OnBadSample read_on_bad_sample(config::Section& cfg) {
  return cfg.get_choice("on_bad_sample", "error", {"error", "skip"}) == "skip" ? OnBadSample::Skip : OnBadSample::Error;
}

std::vector<double> read_double_list(config::Section& cfg, const std::string& key, const std::vector<double>& def, double min_exclusive) {
  cfg.accept(key);
  YAML::Node node = cfg.node();
  if (cfg.is_null(key)) {
    YAML::Node seq(YAML::NodeType::Sequence);
    for (double x : def) seq.push_back(x);
    node[key] = seq;
    return def;
  }
  YAML::Node v = node[key];
  std::vector<double> out;
  if (v.IsSequence()) {
    for (const auto& e : v) {
      double x;
      if (!e.IsScalar() || !YAML::convert<double>::decode(e, x)) {
        out.clear();
        break;
      }
      out.push_back(x);
    }
  }
  if (out.size() != def.size() || std::any_of(out.begin(), out.end(), [&](double x) { return !(x > min_exclusive); }))
    cfg.fail(key, fmt::format("expected a list of {} numbers above {}", def.size(), min_exclusive));
  return out;
}

namespace {

enum class Crop { RandomResized, ResizeCenter, Resize };

struct ImageTransform {
  Crop crop = Crop::ResizeCenter;
  int size = 224, resize = 256, channels = 3;
  double scale_lo = 0.08, scale_hi = 1.0, ratio_lo = 3.0 / 4, ratio_hi = 4.0 / 3;
  bool hflip = false, dct_scaling = true;
  float mean[3] = {0, 0, 0}, std[3] = {1, 1, 1};
};

class ImageFolderDataset : public Dataset {
 public:
  ImageFolderDataset(ImageFolderListing listing, ImageTransform t, std::shared_ptr<const BadSampleLog> log)
      : listing_(std::move(listing)), t_(t), log_(std::move(log)) {}
  int64_t size() const override { return static_cast<int64_t>(listing_.samples.size()); }
  std::string describe(int64_t index) const override { return listing_.samples.at(index).first; }
  const std::vector<std::string>& classes() const { return listing_.classes; }

  Sample get(int64_t index, at::Generator& gen) const override {
    const auto& [path, label] = listing_.samples.at(index);
    thread_local Image img;  // each loader thread decodes into its own reused buffer
    try {
      const std::string bytes = read_file_bytes(path);
      const auto [w, h] = image_size(bytes, path);
      SampleRng rng(gen, 0);
      CropBox box = t_.crop == Crop::RandomResized
                        ? random_resized_crop_box(w, h, t_.scale_lo, t_.scale_hi, t_.ratio_lo, t_.ratio_hi, rng)
                    : t_.crop == Crop::ResizeCenter ? resize_center_crop_box(w, h, t_.resize, t_.size)
                                                    : whole_image_box(w, h);
      const bool flip = t_.hflip && rng.uniform() < 0.5;
      // Decoded only where the crop's resampling reads (the same pixels as a whole decode there).
      decode_image_into(bytes, path, t_.channels, t_.dct_scaling ? min_decode_scale(box, t_.size, t_.size) : 1.0, img,
                        DecodeRegion{box.x, box.y, box.w, box.h, t_.size, t_.size});
      auto image = torch::empty({t_.channels, t_.size, t_.size}, torch::kUInt8);
      resample_to_u8(img, box, t_.size, t_.size, image.data_ptr<uint8_t>(), flip);
      return {{"image", image}, {"label", torch::scalar_tensor(label, torch::kInt64)}};
    } catch (const DataError& e) {
      log_->bad(path, e.what());  // rethrows under on_bad_sample: error
      return {};
    }
  }

 private:
  ImageFolderListing listing_;
  ImageTransform t_;
  std::shared_ptr<const BadSampleLog> log_;
};

// Batches leave the loader as uint8 (a quarter of float's bytes through pinned memory and the
// host-to-device copy) and are normalized on the device after the transfer.
class ImageFolderDataModule : public DatasetDataModule {
 public:
  ImageFolderDataModule(std::shared_ptr<const Dataset> train, std::shared_ptr<const Dataset> val, std::shared_ptr<const Dataset> test,
                        LoaderOptions opt, const ImageTransform& t)
      : DatasetDataModule(std::move(train), std::move(val), std::move(test), stack_collate, opt) {
    std::vector<float> scale, shift;
    for (int c = 0; c < t.channels; ++c) {
      scale.push_back(1.f / (255.f * t.std[c]));
      shift.push_back(-t.mean[c] / t.std[c]);
    }
    scale_ = torch::tensor(scale).view({1, t.channels, 1, 1});
    shift_ = torch::tensor(shift).view({1, t.channels, 1, 1});
  }
  Batch on_after_batch_transfer(Batch batch, int64_t) override {
    auto it = batch.tensors.find("image");
    if (it != batch.tensors.end() && it->second.scalar_type() == torch::kUInt8) {
      const auto dev = it->second.device();
      if (scale_.device() != dev) scale_ = scale_.to(dev), shift_ = shift_.to(dev);
      it->second = torch::addcmul(shift_, it->second.to(torch::kFloat32), scale_);  // (v / 255 - mean) / std
    }
    return batch;
  }

 private:
  torch::Tensor scale_, shift_;
};

std::shared_ptr<DataModule> make_image_folder(config::Section& cfg, const DataContext& ctx) {
  const std::string root = cfg.require_string("root");
  const std::string val_root = cfg.get_string("val_root", "");
  const std::string test_root = cfg.get_string("test_root", "");
  ImageTransform train;
  train.size = static_cast<int>(cfg.get_int("image_size", 224, 1, 8192));
  train.resize = static_cast<int>(cfg.get_int("resize_size", std::max<int64_t>(train.size, train.size * 8 / 7), 1, 16384));
  if (train.resize < train.size) cfg.fail("resize_size", fmt::format("must be >= image_size ({})", train.size));
  train.channels = static_cast<int>(cfg.get_int("channels", 3, 1, 3));
  if (train.channels == 2) cfg.fail("channels", "expected 1 (luminance) or 3 (RGB)");
  const std::string crop = cfg.get_choice("train_transform", "random_resized_crop", {"random_resized_crop", "resize_center_crop", "resize"});
  train.crop = crop == "random_resized_crop" ? Crop::RandomResized : crop == "resize_center_crop" ? Crop::ResizeCenter : Crop::Resize;
  train.scale_lo = cfg.get_double("min_scale", 0.08, 1e-6, 1.0);
  train.scale_hi = cfg.get_double("max_scale", 1.0, train.scale_lo, 1.0);
  train.ratio_lo = cfg.get_double("min_ratio", 3.0 / 4.0, 1e-3, 1e3);
  train.ratio_hi = cfg.get_double("max_ratio", 4.0 / 3.0, train.ratio_lo, 1e3);
  train.hflip = cfg.get_bool("hflip", true);
  train.dct_scaling = cfg.get_bool("dct_scaling", true);
  const bool gray = train.channels == 1;
  auto mean = read_double_list(cfg, "mean", gray ? std::vector<double>{0.449} : std::vector<double>{0.485, 0.456, 0.406}, -1e9);
  auto std = read_double_list(cfg, "std", gray ? std::vector<double>{0.226} : std::vector<double>{0.229, 0.224, 0.225}, 0.0);
  for (int c = 0; c < train.channels; ++c) {
    train.mean[c] = static_cast<float>(mean[c]);
    train.std[c] = static_cast<float>(std[c]);
  }
  const OnBadSample on_bad = read_on_bad_sample(cfg);
  LoaderOptions opt = read_loader_options(cfg, ctx, 64);
  cfg.finish();

  ImageTransform eval = train;
  eval.crop = Crop::ResizeCenter;
  eval.hflip = false;
  auto make = [&](const std::string& dir, const ImageTransform& t, const char* split) -> std::shared_ptr<Dataset> {
    auto log = std::make_shared<const BadSampleLog>(fmt::format("image_folder {} ({})", split, dir), on_bad);
    auto listing = list_image_folder(dir, *log);
    if (listing.samples.empty()) throw DataError(fmt::format("{}: no image to {} on", dir, split == std::string("train") ? "train" : "evaluate"));
    return std::make_shared<ImageFolderDataset>(std::move(listing), t, log);
  };
  auto train_ds = make(root, train, "train");
  std::shared_ptr<Dataset> val, test;
  if (!val_root.empty()) val = make(val_root, eval, "val");
  if (!test_root.empty()) test = make(test_root, eval, "test");
  else test = val;
  auto dm = std::make_shared<ImageFolderDataModule>(train_ds, val, test, opt, train);
  DataInfo info;
  info.batch_keys = {"image", "label"};
  info.class_names = std::static_pointer_cast<ImageFolderDataset>(train_ds)->classes();
  // Checked against model.num_classes before any run file is written (a label past the head would
  // fail only at the first step).
  info.num_classes = static_cast<int64_t>(info.class_names.size());
  info.num_classes_source = fmt::format("data.root {} has {} class folders", root, info.num_classes);
  dm->set_info(info);
  return dm;
}

STROBE_REGISTER(data_registry(), "image_folder", make_image_folder);

}  // namespace
}  // namespace strobe::data
