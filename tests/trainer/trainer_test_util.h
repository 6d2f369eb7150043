// Helpers for trainer tests: a tiny, fast experiment (an MLP on synthetic images) built through the
// same path as the CLI, in a fresh temporary run directory.
#pragma once

#include <stdlib.h>  // mkdtemp

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/config.h"
#include "runner/experiment_builder.h"
#include "tests/test_dirs.h"

namespace strobe::testing {

inline std::string tiny_yaml(const std::string& extra_trainer = "") {
  return R"(name: tiny
seed: 7
trainer:
  max_epochs: 2
  log_every_n_steps: 1
  num_sanity_val_steps: 1
  enable_progress_bar: false
  device: cpu
)" + extra_trainer + R"(model:
  name: mlp
  in_features: 64
  hidden: [32, 16]
  num_classes: 4
  dropout: 0.2
data:
  name: synthetic_images
  image_size: 8
  channels: 1
  num_classes: 4
  num_samples: 96
  num_val_samples: 16
  batch_size: 8
  num_workers: 2
optimizer:
  name: adamw
  lr: 0.01
scheduler:
  name: cosine
  warmup_steps: 3
  max_steps: 24
)";
}

// A new, empty folder, removed when the test process ends (tests/test_dirs.h).
inline std::string temp_dir(const std::string& tag) { return new_test_dir("strobe-tests", tag).string(); }

// `ckpt`: --ckpt (read into run->checkpoint); `extra`: RunOptions::extra_callbacks.
inline std::unique_ptr<Run> make_run(const std::string& yaml, const std::vector<std::string>& sets,
                                     const std::string& run_dir, std::optional<std::string> ckpt = std::nullopt,
                                     std::vector<std::shared_ptr<Callback>> extra = {}) {
  auto doc = config::Document::load_string(yaml, "test.yaml");
  for (const auto& s : sets) doc.apply_override(s);
  RunOptions opt;
  if (run_dir.empty())
    opt.create_run_dir = false;  // no files at all
  else
    opt.run_dir = run_dir;
  opt.ckpt = std::move(ckpt);
  opt.extra_callbacks = std::move(extra);
  return build_run(doc, opt);
}

inline std::map<std::string, torch::Tensor> model_tensors(const std::string& ckpt_path) {
  auto d = checkpoint::load_checkpoint_file(ckpt_path);
  std::map<std::string, torch::Tensor> out;
  for (auto& kv : d.tensors)
    if (kv.first.rfind("model/", 0) == 0) out[kv.first] = kv.second;
  return out;
}

inline std::map<std::string, torch::Tensor> params_of(Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& p : m.net().named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

inline bool bitwise_equal(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (auto& kv : a) {
    auto it = b.find(kv.first);
    if (it == b.end() || !torch::equal(kv.second, it->second)) return false;
  }
  return true;
}

// metrics.csv rows as {step -> {column -> text}} (text, so equality is bitwise on what was logged).
inline std::map<int64_t, std::map<std::string, std::string>> read_csv(const std::string& path, const std::string& column) {
  std::ifstream in(path);
  std::string header;
  std::getline(in, header);
  std::vector<std::string> cols;
  std::stringstream hs(header);
  for (std::string c; std::getline(hs, c, ',');) cols.push_back(c);
  std::map<int64_t, std::map<std::string, std::string>> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::stringstream ls(line + ",");
    for (std::string c; std::getline(ls, c, ',');) cells.push_back(c);
    for (size_t i = 2; i < cells.size() && i < cols.size(); ++i)
      if (cols[i] == column && !cells[i].empty()) rows[std::stoll(cells[0])][column] = cells[i];
  }
  return rows;
}

// The first value whose index `eligible` accepts and that exceeds every value before it, and a
// threshold halfway between it and the largest earlier value: a fault keyed on "value > threshold"
// then fires first at that index. nullopt when no value qualifies.
struct FirstRise {
  size_t index;
  double threshold;
};
template <typename Eligible>
std::optional<FirstRise> first_rise(const std::vector<double>& values, Eligible eligible) {
  double earlier = -1e9;
  for (size_t i = 0; i < values.size(); ++i) {
    if (eligible(i) && values[i] > earlier) return FirstRise{i, (earlier + values[i]) / 2};
    earlier = std::max(earlier, values[i]);
  }
  return std::nullopt;
}

// Mean "image" value of the first n training batches of `yaml`'s data, in the order training sees
// them (the NaN tests' faults trigger on it, so a test knows on the host which steps go bad).
inline std::vector<double> batch_means(const std::string& yaml, int64_t n) {
  auto run = make_run(yaml, {}, "");
  run->datamodule->setup(Stage::Fit);
  auto loader = run->datamodule->train_loader();
  loader->start(0, 0);
  std::vector<double> out;
  for (int64_t i = 0; i < n; ++i) {
    auto b = loader->next();
    if (!b) break;
    out.push_back(b->at("image").flatten(1).mean().item<double>());
  }
  loader->stop();
  return out;
}

}  // namespace strobe::testing
