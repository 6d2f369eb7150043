// DataModule (LightningDataModule): the loaders of each stage and the batch hooks the trainer calls
// around the host-to-device copy, in this order:
//   on_before_batch_transfer -> transfer_batch_to_device -> on_after_batch_transfer.
// A batch can be injected (replay of a NaN capture): while set, it replaces every training batch
// before on_before_batch_transfer.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "strobe/config/registry.h"
#include "strobe/data/batch.h"
#include "strobe/data/loader.h"

namespace strobe {

enum class Stage { Fit, Validate, Test, Predict };

// What a data factory needs besides its config section.
struct DataContext {
  uint64_t seed = 0;
  int64_t rank = 0;
  int64_t world_size = 1;
  bool pin_memory = false;  // true when training on CUDA
};

// What a data module knows about its samples, checked against the model's keys at setup so that a
// mismatch is a config error naming both keys instead of an index error in the first step.
// 0 = not known / not applicable. `*_key` names the data key that sets the value ("" when the
// dataset fixes it, as Fashion-MNIST fixes 10 classes of 1-channel 28x28 images).
struct DataInfo {
  int64_t num_classes = 0;  // labels lie in [0, num_classes)
  std::string num_classes_key;
  int64_t channels = 0;  // images are [channels, image_size, image_size]
  std::string channels_key;
  int64_t image_size = 0;
  std::string image_size_key;
  int64_t vocab_size = 0;  // token ids lie in [0, vocab_size)
  std::string vocab_size_key;
  int64_t max_seq_len = 0;  // sequences are at most this long
  std::string max_seq_len_key;
  // Where vocab_size comes from when no key of the data sets it, for messages: e.g. "the largest
  // token id in train.bin is 50256" (vocab_size is then that id + 1).
  std::string vocab_size_source;
  // The keys every batch carries ({"tokens", "targets"}, {"image", "label"}); empty: not declared.
  // The model's and the task's batch_keys() are checked against them before the first step.
  std::vector<std::string> batch_keys;
  // The classes' names by label (image_folder's folder names); empty: not known.
  std::vector<std::string> class_names;
  // A mix of sources (data.sources): their names by index, the batches' "source" values; the fit
  // loop logs each one's share of the training tokens as train/tokens/<name>.
  std::vector<std::string> source_names;
  // Values per sample of a flat feature vector ("image" of tensor_file), checked against the
  // model's in_features; and of a regression target, checked against its output width (num_classes).
  int64_t feature_width = 0;
  std::string feature_width_key;
  // "image" holds flat vectors ([samples, feature_width]), which a model of images cannot read.
  bool flat_features = false;
  int64_t target_width = 0;
  // Where num_classes comes from when no key sets it, for messages ("data.root R has 4 class folders").
  std::string num_classes_source;
};

class DataModule {
 public:
  virtual ~DataModule() = default;
  virtual DataInfo info() const { return info_; }
  void set_info(DataInfo info) { info_ = std::move(info); }
  virtual void setup(Stage /*stage*/) {}
  virtual std::shared_ptr<data::DataLoader> train_loader() { return nullptr; }
  virtual std::shared_ptr<data::DataLoader> val_loader() { return nullptr; }
  virtual std::shared_ptr<data::DataLoader> test_loader() { return nullptr; }
  virtual std::shared_ptr<data::DataLoader> predict_loader() { return test_loader(); }

  virtual Batch on_before_batch_transfer(Batch batch, int64_t /*dataloader_idx*/) { return batch; }
  virtual Batch transfer_batch_to_device(const Batch& batch, const torch::Device& device, int64_t dataloader_idx);
  virtual Batch on_after_batch_transfer(Batch batch, int64_t /*dataloader_idx*/) { return batch; }

  void inject_batch(std::optional<Batch> batch) { injected_ = std::move(batch); }
  const std::optional<Batch>& injected_batch() const { return injected_; }

 private:
  std::optional<Batch> injected_;
  DataInfo info_;
};

// The usual case: one dataset per stage, one collate function, one set of loader options.
class DatasetDataModule : public DataModule {
 public:
  DatasetDataModule(std::shared_ptr<const data::Dataset> train, std::shared_ptr<const data::Dataset> val,
                    std::shared_ptr<const data::Dataset> test, data::CollateFn collate, data::LoaderOptions options);
  std::shared_ptr<data::DataLoader> train_loader() override;
  std::shared_ptr<data::DataLoader> val_loader() override;
  std::shared_ptr<data::DataLoader> test_loader() override;

 private:
  std::shared_ptr<const data::Dataset> train_, val_, test_;
  data::CollateFn collate_;
  data::LoaderOptions opt_;
  std::shared_ptr<data::DataLoader> train_loader_, val_loader_, test_loader_;
};

using DataRegistry = Registry<std::shared_ptr<DataModule>, const DataContext&>;
DataRegistry& data_registry();

// Reads the loader keys every data section shares: batch_size, num_workers, shuffle, drop_last,
// prefetch_factor (and fills seed/rank/world_size/pin_memory from the context).
data::LoaderOptions read_loader_options(config::Section& cfg, const DataContext& ctx, int64_t default_batch_size = 32);

}  // namespace strobe
