// The checkpoint entries that belong to no single loop or step object (state_connector.h: each is a
// Stateful registered by the Trainer, trainer_state.cpp): the model's weights, the optimizer (a
// libtorch class), the generators, the callbacks' states and the run's records (its resolved config, the Hugging Face config its weights
// came with, the meta blob).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "strobe/config/precision.h"
#include "strobe/checkpoint/stateful.h"

namespace torch::optim {
class Optimizer;
}

namespace strobe {

class Callback;
class MasterWeights;
class Module;
class TrainerView;
namespace distributed {
class Strategy;
class Zero2Shards;
}

// `model`: tensors model/<parameter or buffer> (bf16-master: the fp32 masters under the parameters'
// names; at a step's start, the buffers as they were). Names and shapes are checked before any
// state is restored (the resume check, strobe/core/resume_compat.h).
class ModelState : public Stateful {
 public:
  ModelState(Module& module, MasterWeights* masters) : module_(module), masters_(masters) {}
  void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
  void load(const checkpoint::CheckpointData& in) override;
  bool training_only() const override { return false; }  // validate/test load the weights too
  // zero2 (from fit's setup): the fp32 values live in the ranks' shards. A save gathers each
  // parameter's whole value (a collective: every rank saves), one at a time, into host memory on
  // the rank that writes the file (`keep_whole_values`; the others keep none, except at a step's
  // start, which every rank writes: NaN capture); a local save (a step's start on one rank alone)
  // has the parameters as this rank holds them (bf16-master: rounded to bf16). A load cuts each
  // value into this rank's shard and the parameter.
  void set_sharded(distributed::Zero2Shards* shards, bool keep_whole_values);

 private:
  Module& module_;
  MasterWeights* masters_;
  distributed::Zero2Shards* shards_ = nullptr;
  bool keep_whole_ = true;
  std::map<std::string, size_t> shard_index_;
};

// `optimizer`: torch::optim's archive of the optimizer (fused ones included), loaded onto `device`.
class OptimizerState : public Stateful {
 public:
  OptimizerState(torch::optim::Optimizer& optimizer, torch::Device device) : optimizer_(optimizer), device_(device) {}
  void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
  void load(const checkpoint::CheckpointData& in) override;

 private:
  torch::optim::Optimizer& optimizer_;
  torch::Device device_;
};

// `rng`: this process's generators as rng/cpu, rng/cuda/<i>. Data parallel: every rank's states,
// gathered to rank 0 (a collective: every rank builds each checkpoint), as rng/rank<r>/cpu and
// rng/rank<r>/cuda; each rank restores its own (and only its own GPU's generator is touched).
class RngState : public Stateful {
 public:
  RngState(int64_t rank, int64_t world_size, torch::Device device, distributed::Strategy& strategy)
      : rank_(rank), world_size_(world_size), device_(device), strategy_(strategy) {}
  void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
  void load(const checkpoint::CheckpointData& in) override;

 private:
  int64_t rank_, world_size_;
  torch::Device device_;
  distributed::Strategy& strategy_;
};

// `callbacks`: one JSON blob, each callback's state_dict under its state key.
class CallbackStates : public Stateful {
 public:
  explicit CallbackStates(const std::vector<std::shared_ptr<Callback>>& callbacks) : callbacks_(callbacks) {}
  void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
  void load(const checkpoint::CheckpointData& in) override;

 private:
  const std::vector<std::shared_ptr<Callback>>& callbacks_;
};

// `config` (the resolved YAML: compared on resume by resume_compat, never restored) and `hf_config`
// (written when not empty, restored so that export --names hf writes its fields back).
class TextRecord : public Stateful {
 public:
  TextRecord(std::string key, std::string& text, bool restored) : key_(std::move(key)), text_(text), restored_(restored) {}
  void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
  void load(const checkpoint::CheckpointData& in) override;
  bool restorable() const override { return restored_; }
  bool training_only() const override { return false; }

 private:
  std::string key_;
  std::string& text_;
  bool restored_;
};

namespace logging {
class MlflowLogger;
}
// `mlflow`: the MLflow run logger.mlflow logs to (its id, experiment and server), so that a resume
// continues that run. Saved while a logger has a run (or a resumed run's, before its logger starts).
class MlflowRecord : public Stateful {
 public:
  void attach(const logging::MlflowLogger* logger) { logger_ = logger; }
  void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
  void load(const checkpoint::CheckpointData& in) override;
  // The loaded run's id when it was logged to `tracking_uri` ("" otherwise).
  std::string resumed_run(const std::string& tracking_uri) const { return tracking_uri == uri_ ? run_id_ : ""; }

 private:
  const logging::MlflowLogger* logger_ = nullptr;
  std::string run_id_, experiment_id_, uri_;
};

// `meta`: format and Strobe versions, device, precision, global step, epoch, world size (for readers
// of the file: CheckpointView; never restored).
class MetaRecord : public Stateful {
 public:
  MetaRecord(const TrainerView& view, Precision precision) : view_(view), precision_(precision) {}
  void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
  void load(const checkpoint::CheckpointData&) override {}
  bool restorable() const override { return false; }
  bool training_only() const override { return false; }

 private:
  const TrainerView& view_;
  Precision precision_;
};

}  // namespace strobe
