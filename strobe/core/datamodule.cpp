#include "strobe/core/datamodule.h"

#include <torch/torch.h>

namespace strobe {

Batch DataModule::transfer_batch_to_device(const Batch& batch, const torch::Device& device, int64_t) {
  return batch.to(device, /*non_blocking=*/device.is_cuda());
}

DatasetDataModule::DatasetDataModule(std::shared_ptr<const data::Dataset> train, std::shared_ptr<const data::Dataset> val,
                                     std::shared_ptr<const data::Dataset> test, data::CollateFn collate,
                                     data::LoaderOptions options)
    : train_(std::move(train)), val_(std::move(val)), test_(std::move(test)), collate_(std::move(collate)), opt_(options) {}

std::shared_ptr<data::DataLoader> DatasetDataModule::train_loader() {
  if (!train_) return nullptr;
  if (!train_loader_) train_loader_ = std::make_shared<data::DataLoader>(train_, collate_, opt_);
  return train_loader_;
}

namespace {
// Evaluation sees every sample once, in order.
std::shared_ptr<data::DataLoader> eval_loader(std::shared_ptr<const data::Dataset> dataset, const data::CollateFn& collate,
                                              data::LoaderOptions o) {
  o.shuffle = false;
  o.drop_last = false;
  return std::make_shared<data::DataLoader>(std::move(dataset), collate, o);
}
}  // namespace

std::shared_ptr<data::DataLoader> DatasetDataModule::val_loader() {
  if (val_ && !val_loader_) val_loader_ = eval_loader(val_, collate_, opt_);
  return val_loader_;
}

std::shared_ptr<data::DataLoader> DatasetDataModule::test_loader() {
  if (test_ && !test_loader_) test_loader_ = eval_loader(test_, collate_, opt_);
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
  return o;
}

}  // namespace strobe
