// tensor_file: samples from a safetensors file whose tensors share their first dimension (features,
// embeddings, regression targets, precomputed images), memory-mapped as token files are: a file of
// any size costs no RAM up front, sample i is row i of every named tensor.
//   fields: {batch key: tensor name} ({image: x, label: y} for classification, {image: x, target: y}
//           for regression); `image` and `target` reach the model as float32 whatever their stored
//           dtype (uint8 pixels, int32 features), `label` as int64; other fields: floating as
//           float32, integer as int64.
// Validation: val_path, or else the last val_fraction of the rows (the tail, as token_file does);
// test_path, or else the validation rows. Checked at setup (DataError / ConfigError naming the file,
// the field and the tensor): a missing tensor (the file's names listed; a BOOL one named as such),
// tensors of different lengths, an `image` that is one value per sample (a vector, not rows of
// features), a label that is not an integer vector, a negative label, non-finite values in floating
// fields (refused unless allow_nonfinite: true, which counts them and says so), and a val_path or
// test_path whose rows have another shape than path's.
#include <algorithm>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/safetensors.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/data_error.h"
#include "strobe/data/dataset.h"

namespace strobe::data {
namespace {

// The named tensors of one file, rows [first, first + count).
class TensorRows : public Dataset {
 public:
  TensorRows(std::vector<std::pair<std::string, torch::Tensor>> fields, int64_t first, int64_t count)
      : fields_(std::move(fields)), first_(first), count_(count) {}
  int64_t size() const override { return count_; }
  Sample get(int64_t index, at::Generator&) const override {
    Sample s;
    for (const auto& [key, t] : fields_) {
      const torch::Tensor row = t.select(0, first_ + index);
      const bool as_float = t.is_floating_point() || key == "image" || key == "target";  // what a model or a loss reads
      s[key] = row.to(as_float ? torch::kFloat32 : torch::kInt64, /*non_blocking=*/false, /*copy=*/true);
    }
    return s;
  }

 private:
  std::vector<std::pair<std::string, torch::Tensor>> fields_;
  int64_t first_, count_;
};

struct Fields {
  std::vector<std::pair<std::string, std::string>> map;  // batch key -> tensor name, in the config's order
};

// The fields of `path` (mapped), each checked; `rows` is their shared length.
std::vector<std::pair<std::string, torch::Tensor>> open_fields(const std::string& path, const Fields& f, bool allow_nonfinite,
                                                               int64_t& rows) {
  safetensors::File file;
  try {
    file = safetensors::map_file(path);
  } catch (const checkpoint::CheckpointError& e) {
    throw DataError(e.what());
  }
  std::map<std::string, torch::Tensor> by_name(file.tensors.begin(), file.tensors.end());
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::string first_name;
  for (const auto& [key, name] : f.map) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      if (std::find(file.unmapped_bool.begin(), file.unmapped_bool.end(), name) != file.unmapped_bool.end())
        throw DataError(fmt::format("{}: fields.{}: tensor '{}' is BOOL, which tensor_file does not read; store it as uint8 "
                                    "(labels: integer class indices)",
                                    path, key, name));
      std::vector<std::string> names;
      for (const auto& kv : file.tensors) names.push_back(kv.first);
      throw DataError(fmt::format("{}: fields.{}: no tensor '{}' (the file holds: {})", path, key, name, fmt::join(names, ", ")));
    }
    const torch::Tensor& t = it->second;
    if (t.dim() == 0) throw DataError(fmt::format("{}: fields.{}: tensor '{}' is a scalar; every field needs a first dimension of samples", path, key, name));
    if (out.empty()) {
      rows = t.size(0), first_name = name;
    } else if (t.size(0) != rows) {
      throw DataError(fmt::format("{}: fields.{}: tensor '{}' has {} rows but '{}' has {}: every field needs one row per sample", path, key,
                                  name, t.size(0), first_name, rows));
    }
    if (key == "image" && t.dim() == 1)
      throw DataError(fmt::format("{}: fields.image: tensor '{}' is a vector ({} values): one value per sample is not a row of "
                                  "features; store it as [{}, 1]",
                                  path, name, t.size(0), t.size(0)));
    if (key == "label") {
      if (t.is_floating_point() || t.dim() != 1)
        throw DataError(fmt::format("{}: fields.label: tensor '{}' must be a vector of integer class indices, got {} {}", path, name,
                                    c10::toString(t.scalar_type()), c10::str(t.sizes())));
      if (t.numel() > 0 && t.min().item<int64_t>() < 0)
        throw DataError(fmt::format("{}: fields.label: tensor '{}' holds the negative label {}", path, name, t.min().item<int64_t>()));
    }
    if (t.is_floating_point()) {
      const int64_t bad = t.numel() - torch::isfinite(t).sum().item<int64_t>();
      if (bad > 0 && !allow_nonfinite) {
        const int64_t row = torch::isfinite(t.reshape({t.size(0), -1})).logical_not().any(1).nonzero()[0][0].item<int64_t>();
        throw DataError(fmt::format("{}: fields.{}: tensor '{}' holds {} non-finite value{} (the first in row {}); fix the data or set "
                                    "allow_nonfinite: true",
                                    path, key, name, bad, bad == 1 ? "" : "s", row));
      }
      if (bad > 0) fmt::print("strobe: data: {}: fields.{}: {} non-finite values (allow_nonfinite: true)\n", path, key, bad);
    }
    out.emplace_back(key, t);
  }
  return out;
}

std::shared_ptr<DataModule> make_tensor_file(config::Section& cfg, const DataContext& ctx) {
  const std::string path = cfg.require_string("path");
  const std::string val_path = cfg.get_string("val_path", "");
  const std::string test_path = cfg.get_string("test_path", "");
  const double val_fraction = cfg.get_double("val_fraction", 0.0, 0.0, 0.5);
  if (!val_path.empty() && val_fraction > 0) cfg.fail("val_fraction", "give either val_path or val_fraction, not both");
  const bool allow_nonfinite = cfg.get_bool("allow_nonfinite", false);
  Fields f;
  {
    config::Section fields = cfg.child("fields");
    const YAML::Node n = fields.node();
    if (!n.IsMap() || n.size() == 0)
      cfg.fail("fields", "expected a mapping of batch keys to tensor names, e.g. {image: x, label: y} or {image: x, target: y}");
    for (const auto& kv : n) {
      const std::string key = kv.first.Scalar();
      if (!kv.second.IsScalar() || kv.second.Scalar().empty()) fields.fail(key, "expected the name of a tensor in the file");
      f.map.emplace_back(key, kv.second.Scalar());
      fields.accept(key);
    }
    fields.finish();
  }
  LoaderOptions opt = read_loader_options(cfg, ctx, 32);
  cfg.finish();

  int64_t rows = 0;
  auto train_fields = open_fields(path, f, allow_nonfinite, rows);
  const auto n_val = static_cast<int64_t>(static_cast<double>(rows) * val_fraction);
  if (rows - n_val <= 0) throw DataError(fmt::format("{}: {} rows leave no training sample", path, rows));
  auto train = std::make_shared<TensorRows>(train_fields, 0, rows - n_val);
  std::shared_ptr<Dataset> val, test;
  auto labels = [&](const std::vector<std::pair<std::string, torch::Tensor>>& fs, int64_t first, int64_t count) -> int64_t {
    for (const auto& [key, t] : fs)
      if (key == "label" && count > 0) return t.narrow(0, first, count).max().item<int64_t>() + 1;
    return 0;
  };
  int64_t classes = labels(train_fields, 0, rows - n_val);
  if (n_val > 0) {
    val = std::make_shared<TensorRows>(train_fields, rows - n_val, n_val);
    classes = std::max(classes, labels(train_fields, rows - n_val, n_val));
  }
  // Every split's rows have the training rows' shape (a model is built for one width).
  auto same_rows = [&](const std::string& key_name, const std::string& other,
                       const std::vector<std::pair<std::string, torch::Tensor>>& fs) {
    for (size_t i = 0; i < fs.size(); ++i) {
      const auto a = train_fields[i].second.sizes().slice(1), b = fs[i].second.sizes().slice(1);
      if (a != b)
        cfg.fail(key_name, fmt::format("{}: fields.{}: rows of shape {} (tensor '{}'), but {}'s rows are {}", other, fs[i].first,
                                       c10::str(b), f.map[i].second, path, c10::str(a)));
    }
  };
  if (!val_path.empty()) {
    int64_t val_rows = 0;
    auto fs = open_fields(val_path, f, allow_nonfinite, val_rows);
    same_rows("val_path", val_path, fs);
    val = std::make_shared<TensorRows>(fs, 0, val_rows);
    classes = std::max(classes, labels(fs, 0, val_rows));
  }
  test = val;
  if (!test_path.empty()) {
    int64_t test_rows = 0;
    auto fs = open_fields(test_path, f, allow_nonfinite, test_rows);
    same_rows("test_path", test_path, fs);
    test = std::make_shared<TensorRows>(fs, 0, test_rows);
    classes = std::max(classes, labels(fs, 0, test_rows));
  }
  auto dm = std::make_shared<DatasetDataModule>(train, val, test, stack_collate, opt);
  DataInfo info;
  for (const auto& [key, name] : f.map) info.batch_keys.push_back(key);
  if (classes > 0) info.num_classes = classes;  // no key sets it: "data 'tensor_file' has N classes"
  // The width of a flat feature vector, for the mlp's in_features (channels 1 x 1 x width does not
  // fit an image model's checks, so only what an MLP reads is declared).
  for (const auto& [key, t] : train_fields) {
    if (key == "image") info.feature_width = t.numel() / std::max<int64_t>(t.size(0), 1);
    if (key == "image" && t.dim() == 2) info.flat_features = true;  // an image model cannot read them
    if (key == "target") info.target_width = t.dim() == 1 ? 1 : t.numel() / std::max<int64_t>(t.size(0), 1);
  }
  dm->set_info(info);
  return dm;
}

STROBE_REGISTER(data_registry(), "tensor_file", make_tensor_file);

}  // namespace
}  // namespace strobe::data
