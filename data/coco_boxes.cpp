// coco_boxes: detection data from a COCO-format annotation file (images, annotations with bbox =
// [x, y, width, height] in pixels) and its image folder, shaped for the face detector exactly like
// synthetic_boxes: "image" uint8 [channels, S, S] (the whole image resized to S x S), "boxes" float
// [max_boxes, 4] as (x1, y1, x2, y2) in pixels of the resized image, sorted by (y1, x1, y2, x2) and
// zero-padded (a row is a box when y2 > 0), "num_boxes" int64. An image may have no box. Images keep
// the file's order; crowd annotations (iscrowd: 1) are left out; boxes beyond max_boxes are cut (the
// count is printed once at setup).
//
// Bad data (DataError naming the file; under on_bad_sample: skip counted and left out): an annotation
// file that is not COCO JSON, an annotation whose image_id is not listed or whose bbox is not four
// numbers with positive width and height inside the image, an image file that is missing,
// unreadable, truncated or not JPEG/PNG, or whose size differs from its width/height in the file.
#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "data/image_codec.h"
#include "data/image_folder.h"
#include "data/image_transforms.h"
#include "data/synthetic_rng.h"
#include "strobe/checkpoint/json_text.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/dataset.h"

namespace strobe::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct CocoImage {
  std::string path;
  int64_t id = 0, width = 0, height = 0;  // width/height 0: not given
  std::vector<std::array<double, 4>> boxes;  // x, y, w, h in the stored image's pixels
};

std::vector<CocoImage> read_coco(const std::string& ann_path, const std::string& image_dir, const BadSampleLog& log) {
  require_regular_file(ann_path);
  std::ifstream in(ann_path);
  if (!in) throw DataError(fmt::format("{}: cannot open the annotation file", ann_path));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!checkpoint::json_nesting_within(text))
    throw DataError(fmt::format("{}: nests deeper than {} levels: not a COCO annotation file", ann_path, checkpoint::kMaxJsonDepth));
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    throw DataError(fmt::format("{}: not valid JSON ({})", ann_path, e.what()));
  }
  if (!doc.is_object() || !doc.contains("images") || !doc["images"].is_array())
    throw DataError(fmt::format("{}: not a COCO annotation file (no \"images\" list)", ann_path));
  std::vector<CocoImage> images;
  std::map<int64_t, size_t> by_id;
  for (const auto& im : doc["images"]) {
    if (!im.is_object() || !im.contains("id") || !im["id"].is_number_integer() || !im.contains("file_name") || !im["file_name"].is_string())
      throw DataError(fmt::format("{}: an image entry lacks an integer \"id\" or a \"file_name\": {}", ann_path, im.dump().substr(0, 120)));
    CocoImage ci;
    ci.id = im["id"].get<int64_t>();
    ci.path = (fs::path(image_dir) / im["file_name"].get<std::string>()).string();
    if (im.contains("width") && im["width"].is_number_integer()) ci.width = im["width"].get<int64_t>();
    if (im.contains("height") && im["height"].is_number_integer()) ci.height = im["height"].get<int64_t>();
    if (by_id.count(ci.id)) throw DataError(fmt::format("{}: image id {} is listed twice", ann_path, ci.id));
    std::error_code ec;
    if (!fs::is_regular_file(ci.path, ec)) {
      log.bad(ci.path, fmt::format("{}: image {} of {} is missing", ci.path, ci.id, ann_path));
      by_id[ci.id] = SIZE_MAX;
      continue;
    }
    by_id[ci.id] = images.size();
    images.push_back(std::move(ci));
  }
  const json empty = json::array();
  const json& anns = doc.contains("annotations") ? doc["annotations"] : empty;
  if (!anns.is_array()) throw DataError(fmt::format("{}: \"annotations\" is not a list", ann_path));
  for (const auto& a : anns) {
    const std::string id = a.is_object() && a.contains("id") ? a["id"].dump() : "?";
    const std::string key = fmt::format("{}#annotation{}", ann_path, id);
    if (!a.is_object() || !a.contains("image_id") || !a["image_id"].is_number_integer()) {
      log.bad(key, fmt::format("{}: annotation {} has no integer image_id", ann_path, id));
      continue;
    }
    auto it = by_id.find(a["image_id"].get<int64_t>());
    if (it == by_id.end()) {
      log.bad(key, fmt::format("{}: annotation {} refers to image_id {}, which no image has", ann_path, id, a["image_id"].dump()));
      continue;
    }
    if (it->second == SIZE_MAX) continue;  // its image is missing (already reported)
    if (a.contains("iscrowd") && a["iscrowd"].is_number() && a["iscrowd"].get<double>() != 0) continue;
    const json& b = a.contains("bbox") ? a["bbox"] : json();
    bool ok = b.is_array() && b.size() == 4 && std::all_of(b.begin(), b.end(), [](const json& v) { return v.is_number(); });
    std::array<double, 4> box{};
    if (ok) {
      for (int k = 0; k < 4; ++k) box[k] = b[k].get<double>();
      ok = box[2] > 0 && box[3] > 0 && box[0] + box[2] > 0 && box[1] + box[3] > 0;
    }
    if (!ok) {
      log.bad(key, fmt::format("{}: annotation {} has bbox {} (expected [x, y, width, height], width and height > 0, inside the image)",
                               ann_path, id, b.dump()));
      continue;
    }
    images[it->second].boxes.push_back(box);
  }
  return images;
}

class CocoBoxes : public Dataset {
 public:
  CocoBoxes(std::vector<CocoImage> images, int64_t size, int64_t max_boxes, int channels, bool hflip,
            std::shared_ptr<const BadSampleLog> log)
      : images_(std::move(images)), s_(size), max_boxes_(max_boxes), channels_(channels), hflip_(hflip), log_(std::move(log)) {}
  int64_t size() const override { return static_cast<int64_t>(images_.size()); }
  std::string describe(int64_t index) const override { return images_.at(index).path; }

  Sample get(int64_t index, at::Generator& gen) const override {
    const CocoImage& ci = images_.at(index);
    try {
      const std::string bytes = read_file_bytes(ci.path);
      const auto [w, h] = image_size(bytes, ci.path);
      if ((ci.width && ci.width != w) || (ci.height && ci.height != h))
        throw DataError(fmt::format("{}: the image is {}x{} but its annotation says {}x{}", ci.path, w, h, ci.width, ci.height));
      const bool flip = hflip_ && SampleRng(gen, 0).uniform() < 0.5;
      const CropBox whole = whole_image_box(w, h);
      Image img = decode_image(bytes, ci.path, channels_, min_decode_scale(whole, static_cast<int>(s_), static_cast<int>(s_)));
      auto image = torch::empty({channels_, s_, s_}, torch::kUInt8);
      resample_to_u8(img, whole, static_cast<int>(s_), static_cast<int>(s_), image.data_ptr<uint8_t>());
      if (flip) image = image.flip({2}).contiguous();
      const double fx = static_cast<double>(s_) / w, fy = static_cast<double>(s_) / h, S = static_cast<double>(s_);
      std::vector<std::array<double, 4>> boxes;
      for (const auto& b : ci.boxes) {
        if (b[0] >= w || b[1] >= h)
          throw DataError(fmt::format("{}: an annotated box starts at ({}, {}), outside the {}x{} image", ci.path, b[0], b[1], w, h));
        double x1 = std::clamp(b[0] * fx, 0.0, S), y1 = std::clamp(b[1] * fy, 0.0, S);
        double x2 = std::clamp((b[0] + b[2]) * fx, 0.0, S), y2 = std::clamp((b[1] + b[3]) * fy, 0.0, S);
        if (flip) std::tie(x1, x2) = std::make_pair(S - x2, S - x1);
        boxes.push_back({x1, y1, x2, y2});
      }
      std::sort(boxes.begin(), boxes.end(), [](const auto& a, const auto& b) {
        return std::tie(a[1], a[0], a[3], a[2]) < std::tie(b[1], b[0], b[3], b[2]);
      });
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(boxes.size()), max_boxes_);
      auto target = torch::zeros({max_boxes_, 4}, torch::kFloat32);
      float* t = target.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i)
        for (int k = 0; k < 4; ++k) t[i * 4 + k] = static_cast<float>(boxes[i][k]);
      return {{"image", image}, {"boxes", target}, {"num_boxes", torch::scalar_tensor(n, torch::kInt64)}};
    } catch (const DataError& e) {
      log_->bad(ci.path, e.what());
      return {};
    }
  }

 private:
  std::vector<CocoImage> images_;
  int64_t s_, max_boxes_;
  int channels_;
  bool hflip_;
  std::shared_ptr<const BadSampleLog> log_;
};

std::shared_ptr<DataModule> make_coco_boxes(config::Section& cfg, const DataContext& ctx) {
  const std::string ann = cfg.require_string("annotations");
  const std::string images = cfg.get_string("images", fs::path(ann).parent_path().string());
  const std::string val_ann = cfg.get_string("val_annotations", "");
  const std::string val_images = cfg.get_string("val_images", val_ann.empty() ? "" : fs::path(val_ann).parent_path().string());
  const int64_t image_size = cfg.get_int("image_size", 256, 16, 8192);
  const int64_t max_boxes = cfg.get_int("max_boxes", 256, 1);
  const int channels = static_cast<int>(cfg.get_int("channels", 1, 1, 3));
  if (channels == 2) cfg.fail("channels", "expected 1 (luminance) or 3 (RGB)");
  const bool hflip = cfg.get_bool("hflip", false);
  const OnBadSample on_bad = read_on_bad_sample(cfg);
  LoaderOptions opt = read_loader_options(cfg, ctx, 32);
  cfg.finish();
  auto make = [&](const std::string& a, const std::string& dir, bool flip, const char* split) {
    auto log = std::make_shared<const BadSampleLog>(fmt::format("coco_boxes {} ({})", split, a), on_bad);
    auto list = read_coco(a, dir, *log);
    if (list.empty()) throw DataError(fmt::format("{}: no usable image", a));
    int64_t cut = 0, over = 0;
    for (const auto& ci : list)
      if (static_cast<int64_t>(ci.boxes.size()) > max_boxes) cut += static_cast<int64_t>(ci.boxes.size()) - max_boxes, ++over;
    if (cut > 0)
      fmt::print(stderr, "strobe: data: coco_boxes {}: {} image(s) have more than max_boxes = {} boxes; {} box(es) beyond it are cut\n",
                 a, over, max_boxes, cut);
    return std::make_shared<CocoBoxes>(std::move(list), image_size, max_boxes, channels, flip, log);
  };
  auto train = make(ann, images, hflip, "train");
  std::shared_ptr<Dataset> val;
  if (!val_ann.empty()) val = make(val_ann, val_images, false, "val");
  auto dm = std::make_shared<DatasetDataModule>(train, val, val, stack_collate, opt);
  DataInfo info;
  info.batch_keys = {"image", "boxes", "num_boxes"};
  dm->set_info(info);
  return dm;
}

STROBE_REGISTER(data_registry(), "coco_boxes", make_coco_boxes);

}  // namespace
}  // namespace strobe::data
