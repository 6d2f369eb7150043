// The entries of a checkpoint that belong to no loop or step object (run_state.h): the model's
// tensors, the optimizer's archive, the generators, the callbacks' states and the run's records; and
// the loop counters' and generators' codecs (loop_state.h).
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <cereal/archives/portable_binary.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/callback.h"
#include "strobe/core/loop_state.h"
#include "strobe/core/master_weights.h"
#include "strobe/core/module.h"
#include "strobe/core/precision.h"
#include "strobe/core/trainer_view.h"
#include "strobe/core/run_state.h"
#include "strobe/core/rng_state.h"
#include "strobe/distributed/strategy.h"
#include "strobe/logging/log_collector.h"
#include "strobe/logging/mlflow_logger.h"

namespace strobe {

template <class Archive>
void serialize(Archive& ar, TrainerState& s) {
  ar(s.epoch, s.global_step, s.batch_in_epoch, s.batches_seen, s.val_runs, s.epoch_done, s.elapsed_s);
}

namespace {

std::string archive_to_string(torch::serialize::OutputArchive& a) {
  std::ostringstream os;
  a.save_to(os);
  return os.str();
}

}  // namespace

std::string serialize_loop_state(const TrainerState& state) {
  std::ostringstream os;
  {
    cereal::PortableBinaryOutputArchive ar(os);
    ar(state);
    ar(state.sample_offset);  // after the first fields, so older blobs still read
  }
  return os.str();
}

TrainerState parse_loop_state(const std::string& blob) {
  TrainerState s;
  std::istringstream is(blob);
  cereal::PortableBinaryInputArchive ar(is);
  ar(s);
  if (is.peek() != std::char_traits<char>::eof()) ar(s.sample_offset);
  return s;
}

RngSnapshot snapshot_rng(bool cuda) {
  RngSnapshot r;
  r.cpu = generator_state(-1);
  if (cuda)
    for (size_t i = 0; i < torch::cuda::device_count(); ++i)
      r.cuda.emplace_back(static_cast<int>(i), generator_state(static_cast<int>(i)));
  return r;
}

void ModelState::set_sharded(distributed::Zero2Shards* shards, bool keep_whole_values) {
  shards_ = shards;
  keep_whole_ = keep_whole_values;
  shard_index_.clear();
  if (shards_)
    for (size_t i = 0; i < shards_->names().size(); ++i) shard_index_[shards_->names()[i]] = i;
}

void ModelState::save(checkpoint::CheckpointData& d, const StepStart* at) {
  // bf16-master: the fp32 masters, under the parameters' names.
  for (const auto& p : module_.net().named_parameters()) {
    torch::Tensor value;
    auto it = shard_index_.find(p.key());
    if (it != shard_index_.end() && !(at && at->local)) {
      // zero2: the whole value, gathered one parameter at a time into the writing rank's memory.
      value = shards_->full_value(it->second);
      if (!keep_whole_ && !at) continue;  // a step's start (NaN capture) is written by every rank
      value = value.to(torch::kCPU);
    } else if (it != shard_index_.end()) {
      // zero2, a local save: the parameter as this rank holds it.
      value = p.value().detach();
      if (value.scalar_type() != torch::kFloat32 && masters_) value = value.to(torch::kFloat32);
    } else {
      value = (masters_ ? masters_->master_of(p.value()) : p.value()).detach();
    }
    d.tensors[checkpoint_keys::kModelPrefix + p.key()] = value;
  }
  for (const auto& b : module_.net().named_buffers()) {
    const auto* before = at && at->buffers.count(b.key()) ? &at->buffers.at(b.key()) : nullptr;
    d.tensors[checkpoint_keys::kModelPrefix + b.key()] = before ? *before : b.value();
  }
}

void ModelState::load(const checkpoint::CheckpointData& d) {
  torch::NoGradGuard ng;
  auto load_into = [&](const std::string& key, torch::Tensor target) {
    target.copy_(d.tensor(checkpoint_keys::kModelPrefix + key));
  };
  for (auto& p : module_.net().named_parameters()) {
    auto it = shard_index_.find(p.key());
    if (it != shard_index_.end()) {  // zero2: this rank's shard and the parameter
      const auto& t = d.tensor(checkpoint_keys::kModelPrefix + p.key());
      shards_->load_full_value(it->second, t.to(p.value().device(), torch::kFloat32));
      continue;
    }
    load_into(p.key(), masters_ ? masters_->master_of(p.value()) : p.value());
  }
  for (auto& b : module_.net().named_buffers()) load_into(b.key(), b.value());
  if (masters_) masters_->copy_to_model();
  if (shards_ && shards_->fully_sharded()) shards_->refresh_kept_units();  // fsdp: root's whole values
}

void OptimizerState::save(checkpoint::CheckpointData& d, const StepStart*) {
  torch::serialize::OutputArchive a;
  optimizer_.save(a);
  d.blobs[checkpoint_keys::kOptimizer] = archive_to_string(a);
}

void OptimizerState::load(const checkpoint::CheckpointData& d) {
  if (!d.has_blob(checkpoint_keys::kOptimizer) || d.blob(checkpoint_keys::kOptimizer).empty()) return;  // empty: not restored (Trainer::restore_training_state)
  torch::serialize::InputArchive a;
  std::istringstream is(d.blob(checkpoint_keys::kOptimizer));
  a.load_from(is, device_);
  optimizer_.load(a);
}

void RngState::save(checkpoint::CheckpointData& d, const StepStart* at) {
  auto put = [&](const RngSnapshot& r) {
    d.tensors[checkpoint_keys::rng_cpu()] = r.cpu;
    for (const auto& [i, state] : r.cuda) d.tensors[checkpoint_keys::rng_cuda(i)] = state;
  };
  if (at) {  // this process's generators at the step's start, never a gather (no collective)
    put(at->rng);
    return;
  }
  if (world_size_ == 1) {
    put(snapshot_rng(torch::cuda::is_available()));
    return;
  }
  // Data parallel: this process's CPU generator and its own GPU's, gathered from every rank.
  std::map<std::string, torch::Tensor> mine{{"cpu", snapshot_rng(false).cpu}};
  if (device_.is_cuda()) mine["cuda"] = generator_state(device_.index());
  torch::serialize::OutputArchive a;
  for (auto& [k, t] : mine) a.write(k, t);
  auto all = strategy_.gather_strings(archive_to_string(a));
  for (size_t r = 0; r < all.size(); ++r) {
    torch::serialize::InputArchive in;
    std::istringstream is(all[r]);
    in.load_from(is);
    for (const char* k : {"cpu", "cuda"}) {
      torch::Tensor t;
      if (in.try_read(k, t)) d.tensors[checkpoint_keys::rng_of_rank(static_cast<int64_t>(r), k)] = t;
    }
  }
  d.tensors[checkpoint_keys::rng_cpu()] = mine["cpu"];
  if (mine.count("cuda")) d.tensors[checkpoint_keys::rng_cuda(device_.index())] = mine["cuda"];
}

void RngState::load(const checkpoint::CheckpointData& d) {
  const std::string own_cpu = checkpoint_keys::rng_of_rank(rank_, "cpu"), own_cuda = checkpoint_keys::rng_of_rank(rank_, "cuda");
  if (world_size_ > 1 && d.tensors.count(own_cpu)) {
    set_generator_state(-1, d.tensor(own_cpu));
    if (device_.is_cuda() && d.tensors.count(own_cuda)) set_generator_state(device_.index(), d.tensor(own_cuda));
    return;
  }
  // One process, or a rank the checkpoint's run did not have (resumed on more processes, or from one
  // process): the writer's generators, rank 0's, which every rank of a run starts from (one seed).
  set_generator_state(-1, d.tensor(checkpoint_keys::rng_cpu()));
  if (world_size_ > 1) {
    if (!device_.is_cuda()) return;
    auto it = d.tensors.find(checkpoint_keys::rng_of_rank(0, "cuda"));
    if (it == d.tensors.end())  // a one-process checkpoint: its GPU's generator, whichever GPU that was
      for (it = d.tensors.begin(); it != d.tensors.end(); ++it)
        if (it->first.rfind(checkpoint_keys::rng_cuda_prefix(), 0) == 0) break;
    if (it != d.tensors.end()) set_generator_state(device_.index(), it->second);
    return;
  }
  if (torch::cuda::is_available()) {
    for (size_t i = 0; i < torch::cuda::device_count(); ++i) {
      auto it = d.tensors.find(checkpoint_keys::rng_cuda(i));
      if (it != d.tensors.end()) set_generator_state(static_cast<int>(i), it->second);
    }
  }
}

void CallbackStates::save(checkpoint::CheckpointData& d, const StepStart*) {
  nlohmann::json cbs = nlohmann::json::object();
  for (auto& cb : callbacks_) cbs[cb->state_key()] = cb->state_dict();
  d.blobs[checkpoint_keys::kCallbacks] = cbs.dump();
}

void CallbackStates::load(const checkpoint::CheckpointData& d) {
  const auto cbs = CheckpointView(d, "the checkpoint").callback_states();
  for (auto& cb : callbacks_)
    if (cbs.contains(cb->state_key())) cb->load_state_dict(cbs.at(cb->state_key()));
}

void TextRecord::save(checkpoint::CheckpointData& d, const StepStart*) {
  if (!restored_ || !text_.empty()) d.blobs[key_] = text_;  // the config always; hf_config when there is one
}

void TextRecord::load(const checkpoint::CheckpointData& d) {
  if (d.has_blob(key_)) text_ = d.blob(key_);
}

void MlflowRecord::save(checkpoint::CheckpointData& d, const StepStart*) {
  std::string run = run_id_, experiment = experiment_id_, uri = uri_;
  if (logger_ && !logger_->run_id().empty()) run = logger_->run_id(), experiment = logger_->experiment_id(), uri = logger_->tracking_uri();
  if (run.empty()) return;
  d.blobs[checkpoint_keys::kMlflow] = nlohmann::json{{"run_id", run}, {"experiment_id", experiment}, {"tracking_uri", uri}}.dump();
}

void MlflowRecord::load(const checkpoint::CheckpointData& d) {
  run_id_.clear(), experiment_id_.clear(), uri_.clear();
  if (!d.has_blob(checkpoint_keys::kMlflow)) return;
  try {
    const auto j = nlohmann::json::parse(d.blob(checkpoint_keys::kMlflow));
    run_id_ = j.value("run_id", std::string()), experiment_id_ = j.value("experiment_id", std::string());
    uri_ = j.value("tracking_uri", std::string());
  } catch (const std::exception&) {
    throw checkpoint::CheckpointError(fmt::format("{}: the mlflow entry is not the JSON strobe writes", d.source));
  }
}

void MetaRecord::save(checkpoint::CheckpointData& d, const StepStart* step_start) {
  nlohmann::json meta = {{"format_version", checkpoint::kFormatVersion},
                         {"strobe_version", STROBE_VERSION},
                         {"device", view_.device().str()},
                         {"precision", to_string(precision_)},
                         {"global_step", view_.state().global_step},
                         {"world_size", view_.world_size()},
                         {"epoch", view_.state().epoch}};
  // Data parallel, a checkpoint of a step's start (NaN capture, on_exception_checkpoint): one rank's
  // generators and counters alone, which resume only on the number of processes that wrote them.
  if (step_start && view_.world_size() > 1) meta["rank_alone"] = view_.rank();
  d.blobs[checkpoint_keys::kMeta] = meta.dump();
}

}  // namespace strobe
