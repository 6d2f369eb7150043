// example_points: a DataModule reading this example's own file format, the "strobe-points" text file:
//
//   # strobe-points 1          first line: the format and its version
//   # any comment              further lines starting with '#'
//   dim 2                      the number of coordinates of a point
//   classes 3                  labels lie in [0, classes)
//   <label> <x_1> ... <x_dim>  one point per line
//
// The whole file is read and checked when the data module is built, so a bad file is one line and
// exit 2 before training (config.fail names data.path, the line and what is wrong), never an error in
// a loader worker. The last `val_fraction` of the points is the validation (and test) split.
// Samples: {"point": [dim] float32, "label": [] int64}; batches stack them.
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/dataset.h"

namespace strobe_example {

struct Points {
  int64_t dim = 0, classes = 0;
  std::vector<float> coords;  // [n, dim]
  std::vector<int64_t> labels;
};

// Throws std::runtime_error "<path>:<line>: <what>".
Points read_points(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("{}: cannot be opened", path));
  Points p;
  std::string line;
  int64_t n = 0;
  auto bad = [&](const std::string& what) { return std::runtime_error(fmt::format("{}:{}: {}", path, n, what)); };
  while (std::getline(in, line)) {
    ++n;
    if (n == 1) {
      if (line != "# strobe-points 1") throw bad("not a strobe-points file (its first line must be '# strobe-points 1')");
      continue;
    }
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    if (p.dim == 0 || p.classes == 0) {
      std::string key;
      int64_t value = 0;
      if (!(ls >> key >> value) || (key != "dim" && key != "classes") || value < 1 || !(ls >> std::ws).eof())
        throw bad(fmt::format("expected 'dim N' and 'classes N' before the points, got '{}'", line));
      (key == "dim" ? p.dim : p.classes) = value;
      continue;
    }
    int64_t label = -1;
    if (!(ls >> label) || label < 0 || label >= p.classes)
      throw bad(fmt::format("the label must be an integer in [0, {}), got '{}'", p.classes, line));
    for (int64_t i = 0; i < p.dim; ++i) {
      float v;
      if (!(ls >> v) || !std::isfinite(v)) throw bad(fmt::format("expected {} finite coordinates after the label", p.dim));
      p.coords.push_back(v);
    }
    if (!(ls >> std::ws).eof()) throw bad(fmt::format("more than {} coordinates", p.dim));
    p.labels.push_back(label);
  }
  if (n == 0) throw std::runtime_error(fmt::format("{}: is empty", path));
  if (p.labels.size() < 2) throw std::runtime_error(fmt::format("{}: holds {} points (at least 2 are needed)", path, p.labels.size()));
  return p;
}

class PointsDataset : public strobe::data::Dataset {
 public:
  PointsDataset(std::shared_ptr<const Points> points, int64_t begin, int64_t end) : p_(std::move(points)), begin_(begin), end_(end) {}
  int64_t size() const override { return end_ - begin_; }
  strobe::Sample get(int64_t index, at::Generator&) const override {
    const int64_t i = begin_ + index;
    auto point = torch::from_blob(const_cast<float*>(p_->coords.data()) + i * p_->dim, {p_->dim}, torch::kFloat32).clone();
    return {{"point", point}, {"label", torch::tensor(p_->labels[i], torch::kLong)}};
  }

 private:
  std::shared_ptr<const Points> p_;
  int64_t begin_, end_;
};

// data: {name: example_points, path, val_fraction, batch_size, num_workers, shuffle, drop_last, ...}
std::shared_ptr<strobe::DataModule> make_points_data(strobe::config::Section& cfg, const strobe::DataContext& ctx) {
  const std::string path = cfg.get_string("path", "spirals.pts");
  const double val_fraction = cfg.get_double("val_fraction", 0.2, 0.0, 0.9);
  const auto loader = strobe::read_loader_options(cfg, ctx, 32);
  cfg.finish();
  std::shared_ptr<Points> points;
  try {
    points = std::make_shared<Points>(read_points(path));
  } catch (const std::runtime_error& e) {
    cfg.fail("path", e.what());
  }
  const auto n = static_cast<int64_t>(points->labels.size());
  const int64_t n_val = static_cast<int64_t>(static_cast<double>(n) * val_fraction);
  auto train = std::make_shared<PointsDataset>(points, 0, n - n_val);
  std::shared_ptr<PointsDataset> val;
  if (n_val > 0) val = std::make_shared<PointsDataset>(points, n - n_val, n);
  auto dm = std::make_shared<strobe::DatasetDataModule>(train, val, val, strobe::data::stack_collate, loader);
  strobe::DataInfo info;  // checked against the model's num_classes before training
  info.num_classes = points->classes;
  info.batch_keys = {"point", "label"};
  dm->set_info(info);
  return dm;
}
STROBE_REGISTER(strobe::data_registry(), "example_points", make_points_data);

}  // namespace strobe_example
