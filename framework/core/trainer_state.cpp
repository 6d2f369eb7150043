// Trainer, the state: every piece of state a checkpoint holds is registered with the StateConnector
// here, once; make_checkpoint / load_checkpoint (resume, validate/test), the NaN capture and replay
// all go through it.
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <cereal/archives/portable_binary.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "framework/checkpoint/checkpoint_io.h"
#include "framework/core/checkpoint_view.h"
#include "framework/core/precision.h"
#include "framework/core/resume_compat.h"
#include "framework/core/trainer.h"
#include "framework/distributed/strategy.h"
#include "framework/logging/log_collector.h"

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
  }
  return os.str();
}

TrainerState parse_loop_state(const std::string& blob) {
  TrainerState s;
  std::istringstream is(blob);
  cereal::PortableBinaryInputArchive ar(is);
  ar(s);
  return s;
}

RngSnapshot snapshot_rng(bool cuda) {
  RngSnapshot r;
  {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    r.cpu = cpu.get_state();
  }
  if (cuda) {
    for (size_t i = 0; i < torch::cuda::device_count(); ++i) {
      at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      r.cuda.emplace_back(static_cast<int>(i), gen.get_state());
    }
  }
  return r;
}

void Trainer::register_state() {
  using Kind = StateConnector::Kind;
  using checkpoint::CheckpointData;
  connector_.add(
      "model",
      [this](CheckpointData& d, const StepStart* at) {
        // bf16-master: the fp32 masters, under the parameters' names.
        for (const auto& p : module_->net().named_parameters())
          d.tensors[checkpoint_keys::kModelPrefix + p.key()] = (masters_ ? masters_->master_of(p.value()) : p.value()).detach();
        for (const auto& b : module_->net().named_buffers()) {
          const auto* before = at && at->buffers.count(b.key()) ? &at->buffers.at(b.key()) : nullptr;
          d.tensors[checkpoint_keys::kModelPrefix + b.key()] = before ? *before : b.value();
        }
      },
      [this](const CheckpointData& d) {
        // Names and shapes were checked, both ways, before any state was restored
        // (load_checkpoint_data: weights_mismatch).
        torch::NoGradGuard ng;
        auto load_into = [&](const std::string& key, torch::Tensor target) {
          target.copy_(d.tensor(checkpoint_keys::kModelPrefix + key));
        };
        for (auto& p : module_->net().named_parameters())
          load_into(p.key(), masters_ ? masters_->master_of(p.value()) : p.value());
        for (auto& b : module_->net().named_buffers()) load_into(b.key(), b.value());
        if (masters_) masters_->copy_to_model();
      },
      Kind::Always);
  connector_.add(
      "optimizer",
      [this](CheckpointData& d, const StepStart*) {
        if (!optimizer_) return;
        torch::serialize::OutputArchive a;
        optimizer_->save(a);
        d.blobs["optimizer"] = archive_to_string(a);
      },
      [this](const CheckpointData& d) {
        if (!optimizer_ || !d.has_blob("optimizer")) return;
        torch::serialize::InputArchive a;
        std::istringstream is(d.blob("optimizer"));
        a.load_from(is, device_);
        optimizer_->load(a);
      });
  connector_.add(
      "scheduler",
      [this](CheckpointData& d, const StepStart* at) {
        if (!scheduler_) return;
        nlohmann::json s = scheduler_->state_dict();
        if (at) s["step"] = at->loop.global_step;
        d.blobs["scheduler"] = s.dump();
      },
      [this](const CheckpointData& d) {
        if (scheduler_ && d.has_blob("scheduler")) scheduler_->load_state_dict(nlohmann::json::parse(d.blob("scheduler")));
      });
  connector_.add(
      "scaler",
      [this](CheckpointData& d, const StepStart*) {
        if (!scaler_) return;
        d.tensors["scaler/scale"] = scaler_->scale_tensor();
        d.tensors["scaler/growth_tracker"] = scaler_->growth_tracker();
      },
      [this](const CheckpointData& d) {
        if (scaler_ && d.tensors.count("scaler/scale")) scaler_->load(d.tensor("scaler/scale"), d.tensor("scaler/growth_tracker"));
      });
  // Loop counters are restored for evaluation too, so that its logged step and epoch match.
  connector_.add(
      "loop",
      [this](CheckpointData& d, const StepStart* at) {
        if (at) {
          d.blobs["loop"] = serialize_loop_state(at->loop);
          return;
        }
        d.blobs["loop"] = serialize_loop_state(fit_loop_->saved_state());
      },
      [this](const CheckpointData& d) { fit_loop_->state() = parse_loop_state(d.blob("loop")); },
      Kind::Always);
  // Partial gradients of an unfinished accumulation window.
  connector_.add(
      "accumulation",
      [this](CheckpointData& d, const StepStart* at) {
        const int64_t micro_batches = at ? 0 : fit_loop_->accumulated_batches();  // a step starts with no partial window
        d.blobs["accumulation"] = nlohmann::json{{"micro_batches", micro_batches}}.dump();
        if (micro_batches == 0) return;
        for (const auto& p : module_->net().named_parameters())
          if (p.value().grad().defined()) d.tensors["accumulation/grad/" + p.key()] = p.value().grad();
      },
      [this](const CheckpointData& d) {
        const int64_t micro_batches =
            d.has_blob("accumulation") ? nlohmann::json::parse(d.blob("accumulation")).at("micro_batches").get<int64_t>() : 0;
        fit_loop_->set_accumulated_batches(micro_batches);
        for (auto& p : module_->net().named_parameters()) {
          auto it = d.tensors.find("accumulation/grad/" + p.key());
          if (micro_batches > 0 && it != d.tensors.end())
            p.value().mutable_grad() = it->second.to(p.value().device()).clone();
          else
            p.value().mutable_grad() = torch::Tensor();
        }
      });
  connector_.add(
      "logger", [this](CheckpointData& d, const StepStart*) { collector_->save_state(d); },
      [this](const CheckpointData& d) { collector_->load_state(d); });
  // The sticky skip flag is saved for diagnosis (a checkpoint written after a NaN was detected shows
  // 1) but never restored: a resumed run starts with a clear guard, from the pre-corruption weights.
  connector_.add(
      "step_guard",
      [this](CheckpointData& d, const StepStart* at) {
        if (!pipeline_ || !pipeline_->sticky_flag().defined()) return;
        d.tensors["step/sticky"] = at ? torch::zeros_like(pipeline_->sticky_flag()) : pipeline_->sticky_flag();
      },
      nullptr);
  // RNG: this process's generators as rng/cpu, rng/cuda/<i>. Data parallel: every rank's states,
  // gathered to rank 0 (a collective: every rank builds each checkpoint), as rng/rank<r>/cpu and
  // rng/rank<r>/cuda; each rank restores its own (and only its own GPU's generator is touched).
  connector_.add(
      "rng",
      [this](CheckpointData& d, const StepStart* at) {
        auto put = [&](const RngSnapshot& r) {
          d.tensors["rng/cpu"] = r.cpu;
          for (const auto& [i, state] : r.cuda) d.tensors[fmt::format("rng/cuda/{}", i)] = state;
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
        if (device_.is_cuda()) {
          at::Generator gen = at::globalContext().defaultGenerator(device_);
          std::lock_guard<std::mutex> lock(gen.mutex());
          mine["cuda"] = gen.get_state();
        }
        torch::serialize::OutputArchive a;
        for (auto& [k, t] : mine) a.write(k, t);
        auto all = strategy_->gather_strings(archive_to_string(a));
        for (size_t r = 0; r < all.size(); ++r) {
          torch::serialize::InputArchive in;
          std::istringstream is(all[r]);
          in.load_from(is);
          for (const char* k : {"cpu", "cuda"}) {
            torch::Tensor t;
            if (in.try_read(k, t)) d.tensors[fmt::format("rng/rank{}/{}", r, k)] = t;
          }
        }
        d.tensors["rng/cpu"] = mine["cpu"];
        if (mine.count("cuda")) d.tensors[fmt::format("rng/cuda/{}", device_.index())] = mine["cuda"];
      },
      [this](const CheckpointData& d) { restore_rng(d); });
  connector_.add(
      checkpoint_keys::kCallbacks,
      [this](CheckpointData& d, const StepStart*) {
        nlohmann::json cbs = nlohmann::json::object();
        for (auto& cb : callbacks_) cbs[cb->state_key()] = cb->state_dict();
        d.blobs[checkpoint_keys::kCallbacks] = cbs.dump();
      },
      [this](const CheckpointData& d) {
        const auto cbs = CheckpointView(d, "the checkpoint").callback_states();
        for (auto& cb : callbacks_)
          if (cbs.contains(cb->state_key())) cb->load_state_dict(cbs.at(cb->state_key()));
      });
  connector_.add(
      checkpoint_keys::kConfig,
      [this](CheckpointData& d, const StepStart*) { d.blobs[checkpoint_keys::kConfig] = config_yaml_; }, nullptr,
      Kind::Always);
  connector_.add(
      checkpoint_keys::kHfConfig,
      [this](CheckpointData& d, const StepStart*) {
        if (!hf_source_config_.empty()) d.blobs[checkpoint_keys::kHfConfig] = hf_source_config_;
      },
      [this](const CheckpointData& d) {
        if (const std::string* hf = CheckpointView(d, "the checkpoint").hf_config()) hf_source_config_ = *hf;
      },
      Kind::Always);
  connector_.add(
      checkpoint_keys::kMeta,
      [this](CheckpointData& d, const StepStart*) {
        nlohmann::json meta = {{"format_version", checkpoint::kFormatVersion},
                               {"strobe_version", STROBE_VERSION},
                               {"device", device_.str()},
                               {"precision", to_string(exp_.trainer.precision)},
                               {"global_step", state().global_step},
                               {"world_size", world_size_},
                               {"epoch", state().epoch}};
        d.blobs[checkpoint_keys::kMeta] = meta.dump();
      },
      nullptr, Kind::Always);
}

checkpoint::CheckpointData Trainer::make_checkpoint() { return build_checkpoint(nullptr); }
checkpoint::CheckpointData Trainer::make_checkpoint_at(const StepStart& start) { return build_checkpoint(&start); }

checkpoint::CheckpointData Trainer::build_checkpoint(const StepStart* step_start) {
  checkpoint::CheckpointData d;
  connector_.save(d, step_start);
  each([&](Callback& cb) { cb.on_save_checkpoint(*this, *module_, d); });
  return d;
}

void Trainer::save_checkpoint(const std::string& path) {
  auto d = make_checkpoint();  // every rank: the RNG gather and the logger sums are collectives
  if (rank_ == 0) checkpoint::save_checkpoint_file(path, d);
}

void Trainer::restore_rng(const checkpoint::CheckpointData& d) {
  const std::string own = fmt::format("rng/rank{}/", rank_);
  if (world_size_ > 1 && d.tensors.count(own + "cpu")) {
    {
      at::Generator cpu = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(cpu.mutex());
      cpu.set_state(d.tensor(own + "cpu"));
    }
    if (device_.is_cuda() && d.tensors.count(own + "cuda")) {
      at::Generator gen = at::globalContext().defaultGenerator(device_);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(d.tensor(own + "cuda"));
    }
    return;
  }
  {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(d.tensor("rng/cpu"));
  }
  if (torch::cuda::is_available()) {
    for (size_t i = 0; i < torch::cuda::device_count(); ++i) {
      // Data parallel (a checkpoint without per-rank states): only this rank's own GPU.
      if (world_size_ > 1 && static_cast<c10::DeviceIndex>(i) != device_.index()) continue;
      auto it = d.tensors.find(fmt::format("rng/cuda/{}", i));
      if (it == d.tensors.end()) continue;
      at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(it->second);
    }
  }
}

void Trainer::load_checkpoint(const std::string& path, bool restore_training_state) {
  load_checkpoint_data(take_checkpoint(path), restore_training_state, path);
}

void Trainer::preload_checkpoint(std::string path, checkpoint::CheckpointData data) {
  preloaded_path_ = std::move(path);
  preloaded_ = std::make_unique<checkpoint::CheckpointData>(std::move(data));
}

checkpoint::CheckpointData Trainer::take_checkpoint(const std::string& path) {
  if (preloaded_ && preloaded_path_ == path) {
    checkpoint::CheckpointData data = std::move(*preloaded_);
    preloaded_.reset();
    return data;
  }
  return checkpoint::load_checkpoint_file(path);
}

void Trainer::load_checkpoint_data(const checkpoint::CheckpointData& d, bool restore_training_state, const std::string& source) {
  // Before any state is restored for training: the saved config against the current one (another
  // optimizer, precision or model shape is refused naming the change; the rest is listed by fit).
  resume_changes_.clear();
  // Every load of weights is strict (validate/test too): all names and all shapes, or refused naming
  // the model config keys that differ, else the tensors.
  if (restore_training_state) {
    // A resume restores the whole training state: a checkpoint without its config (the compatibility
    // check), its optimizer state (fresh moments) or its loop counters would resume silently wrong.
    std::vector<std::string> lacking;
    if (!d.has_blob("config")) lacking.push_back("its config (blob 'config')");
    if (optimizer_ && !d.has_blob("optimizer")) lacking.push_back("the optimizer state (blob 'optimizer')");
    if (!d.has_blob("loop")) lacking.push_back("the loop counters (blob 'loop')");
    if (!lacking.empty())
      throw checkpoint::CheckpointError(fmt::format(
          "{}: cannot resume from it: it lacks {}; a file of weights alone is for starting a new run (strobe export it, "
          "then model.init_from)",
          source, fmt::join(lacking, ", ")));
    resume_changes_ = check_resume_compatible(source, d, config_yaml_, module_->net());
  } else if (auto mismatch = weights_mismatch(d, config_yaml_, module_->net()); !mismatch.empty()) {
    throw checkpoint::CheckpointError(fmt::format("{}: the checkpoint's weights do not fit this model: {}", source, mismatch));
  } else if (const std::string changed = function_changes(d, config_yaml_); !changed.empty() && is_global_zero()) {
    // validate/test: the weights fit, but they are evaluated as another function than they were trained as.
    fmt::print(stderr, "strobe: warning: {}: evaluated with model keys that differ from the checkpoint's config: {}\n", source,
               changed);
  }
  connector_.load(d, restore_training_state, source);
  if (restore_training_state) each([&](Callback& cb) { cb.on_load_checkpoint(*this, *module_, d); });
}

}  // namespace strobe
