// CheckpointView: the one reader of a Strobe checkpoint's layout (docs/ARCHITECTURE.md, "The state
// connector": the table of keys). Export, the resume checks, replay, the NaN capture, the run
// builder and the Trainer's world-size check read a CheckpointData through it; the state connector
// (strobe/core/trainer_state.cpp) writes the same keys, named once in checkpoint_keys.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/checkpoint_keys.h"

namespace strobe {

// The `meta` blob: what wrote the checkpoint and where the run stood.
struct CheckpointMeta {
  int64_t format_version = 0;  // 0: not recorded
  std::string strobe_version, device, precision;  // "": not recorded
  std::optional<int64_t> global_step, epoch;
  int64_t world_size = 1;  // not recorded (builds before data parallelism): one process
  // The rank whose state alone a data-parallel checkpoint of a step's start holds (NaN capture,
  // on_exception_checkpoint); none for a checkpoint of the whole run.
  std::optional<int64_t> rank_alone;
};

// The edits a program makes to a checkpoint it restores otherwise than it was written (strobe replay
// re-runs one captured step in one process, maybe on another GPU, under another precision).
class CheckpointEditor {
 public:
  explicit CheckpointEditor(checkpoint::CheckpointData& data) : data_(data) {}
  // The resolved experiment YAML the restored run reads instead of the saved one.
  void set_config(std::string yaml);
  // The log accumulators start empty (their sums are not restored).
  void drop_logger_sums();
  // meta's world_size (when meta is a JSON object): a data-parallel rank's state restored alone.
  void set_world_size(int64_t world_size);
  // The CUDA generator saved for GPU `from` restored onto GPU `to` (nothing when none was saved).
  void move_cuda_generator(int64_t from, int64_t to);

 private:
  checkpoint::CheckpointData& data_;
};

class CheckpointView {
 public:
  // `source` names the checkpoint in errors (its path). The view borrows `data`.
  CheckpointView(const checkpoint::CheckpointData& data, std::string source)
      : data_(data), source_(std::move(source)) {}

  const std::string& source() const { return source_; }
  const checkpoint::CheckpointData& data() const { return data_; }

  // A missing `meta`, one that is not a JSON object, or a field of the wrong type reads as the
  // defaults above (a checkpoint is still loadable without it).
  CheckpointMeta meta() const;
  // The resolved experiment YAML the run was written with; null for a checkpoint without one.
  const std::string* config() const;
  // The same, or a CheckpointError "<source>: holds no saved config (blob 'config')".
  const std::string& require_config() const;
  // The Hugging Face config.json a run was initialised from (model.init_from with names: hf); null if none.
  const std::string* hf_config() const;
  // The model's parameters and buffers by their module names (the "model/" prefix removed).
  std::map<std::string, torch::Tensor> model_tensors() const;
  // One of them; null when the checkpoint does not hold it.
  const torch::Tensor* model_tensor(const std::string& name) const;
  // A weight-averaging callback's averages ("<prefix><name>": the ema callback's "ema/", swa's
  // "swa/") of `weights` (name -> the tensor each averages: the model's parameters and floating
  // buffers), checked: none at all gives {}; otherwise every floating weight has its average, of its
  // shape and a floating dtype, and no average names another tensor, else a CheckpointError naming
  // the tensor (a crafted or damaged checkpoint is refused, exit 2).
  std::map<std::string, torch::Tensor> weight_averages(const std::string& prefix,
                                                       const std::map<std::string, torch::Tensor>& weights) const;
  // Each callback's state_dict by its state key ({} when the checkpoint holds none); a blob that is
  // not a JSON object is a CheckpointError naming the source.
  nlohmann::json callback_states() const;

 private:
  const std::string* blob(const char* key) const;

  const checkpoint::CheckpointData& data_;
  std::string source_;
};

}  // namespace strobe
