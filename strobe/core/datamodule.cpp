#include "strobe/core/datamodule.h"
#include "strobe/core/quarantine.h"

#include "strobe/config/config.h"


#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace strobe {

Batch DataModule::transfer_batch_to_device(const Batch& batch, const torch::Device& device, int64_t) {
  return batch.to(device, /*non_blocking=*/device.is_cuda());
}

DatasetDataModule::DatasetDataModule(std::shared_ptr<const data::Dataset> train, std::shared_ptr<const data::Dataset> val,
                                     std::shared_ptr<const data::Dataset> test, data::CollateFn collate,
                                     data::LoaderOptions options)
    : train_(std::move(train)), val_(std::move(val)), test_(std::move(test)), collate_(std::move(collate)), opt_(options) {
  // data.exclude names indices of each split's own dataset: one past its end is refused before training.
  for (const auto& [split, indices] : opt_.exclude) {
    const auto& ds = split == "train" ? train_ : split == "val" ? val_ : test_;
    if (!ds && !indices.empty())
      throw config::ConfigError(fmt::format("data.exclude: {}: names samples of the {} split, which this data has not", opt_.exclude_file, split));
    for (int64_t i : indices)
      if (i < 0 || i >= ds->size())
        throw config::ConfigError(fmt::format("data.exclude: {}: index {} of the {} split does not exist (it holds {} samples)",
                                              opt_.exclude_file, i, split, ds->size()));
  }
}

std::shared_ptr<data::DataLoader> DatasetDataModule::train_loader() {
  if (!train_) return nullptr;
  if (!train_loader_) {
    data::LoaderOptions o = opt_;
    o.lookahead = true;  // training epochs follow one another (strobe/data/loader.h)
    train_loader_ = std::make_shared<data::DataLoader>(train_, collate_, o);
  }
  return train_loader_;
}

namespace {
// Evaluation sees every sample once, in order.
std::shared_ptr<data::DataLoader> eval_loader(std::shared_ptr<const data::Dataset> dataset, const data::CollateFn& collate,
                                              data::LoaderOptions o, const char* split) {
  o.split = split;
  o.shuffle = false;
  o.drop_last = false;
  return std::make_shared<data::DataLoader>(std::move(dataset), collate, o);
}
}  // namespace

std::shared_ptr<data::DataLoader> DatasetDataModule::val_loader() {
  if (val_ && !val_loader_) val_loader_ = eval_loader(val_, collate_, opt_, "val");
  return val_loader_;
}

std::shared_ptr<data::DataLoader> DatasetDataModule::test_loader() {
  if (test_ && !test_loader_) test_loader_ = eval_loader(test_, collate_, opt_, "test");
  return test_loader_;
}

data::LoaderOptions read_loader_options(config::Section& cfg, const DataContext& ctx, int64_t default_batch_size) {
  data::LoaderOptions o;
  o.batch_size = cfg.get_int("batch_size", default_batch_size, 1);
  o.num_workers = cfg.get_int("num_workers", 2, 0, 256);
  o.shuffle = cfg.get_bool("shuffle", true);
  o.drop_last = cfg.get_bool("drop_last", false);
  o.prefetch_factor = cfg.get_int("prefetch_factor", 2, 1, 64);
  o.pin_memory = ctx.pin_memory;
  o.seed = ctx.seed;
  o.rank = ctx.rank;
  o.world_size = ctx.world_size;
  // data.exclude: a quarantine file (strobe replay --bisect --write-quarantine; docs/NAN_CAPTURE.md).
  if (auto path = cfg.get_optional_string("exclude")) {
    o.exclude_file = *path;
    try {
      for (auto& [split, indices] : read_quarantine(*path).indices)
        o.exclude[split].insert(o.exclude[split].end(), indices.begin(), indices.end());
    } catch (const QuarantineError& e) {
      cfg.fail("exclude", e.what());
    }
  }
  return o;
}

}  // namespace strobe
