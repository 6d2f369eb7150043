// WeightAverages: the fp32 averages of a run's weights that the ema and swa callbacks keep
// (docs/CONFIG.md "ema", "swa"). Bound to TrainerView::weights() (the parameters and floating
// buffers as checkpoints hold them), updated on the device, put into the model for a validation and
// restored bitwise after, saved as "<prefix><name>" and checked whole when loaded. Under
// trainer.strategy fsdp the weights are this rank's rows of the fp32 values (TrainerView::
// sharded_weights()): each rank averages its rows, validation swaps them into the rows the units
// gather from, and a checkpoint holds the averages whole (gathered on every rank, cut again when
// loaded), as under any other strategy.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/checkpoint_view.h"
#include "strobe/core/module.h"
#include "strobe/core/trainer_view.h"

#if STROBE_HAS_OPS
#include "strobe/ops/ops.h"
#endif

namespace strobe {

class WeightAverages {
 public:
  explicit WeightAverages(std::string prefix) : prefix_(std::move(prefix)) {}

  // The averaged tensors' names and live sources, in the view's order (once).
  void bind(TrainerView& t) {
    if (!names_.empty()) return;
    sharded_ = t.sharded_weights();
    for (auto& [name, tensor] : t.weights()) {
      names_.push_back(name);
      sources_.push_back(tensor);
    }
  }
  bool empty() const { return averages_.empty(); }
  const std::vector<std::string>& names() const { return names_; }
  std::vector<torch::Tensor>& averages() { return averages_; }

  // The averages become fp32 copies of the weights.
  void reset_to_weights() {
    torch::NoGradGuard ng;
    averages_.clear();
    for (const auto& s : sources_) averages_.push_back(s.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true));
  }

  // avg += weight * (w - avg), one multi-tensor launch on CUDA; `skipped` (a device flag, or
  // undefined) set to 1 moves nothing, read on the device.
  void update(double weight, const torch::Tensor& skipped) {
    torch::NoGradGuard ng;
#if STROBE_HAS_OPS
    ops::ema_update_(averages_, sources_, weight, skipped.defined() ? skipped.to(averages_[0].device()) : torch::Tensor());
#else
    const torch::Tensor w = skipped.defined() ? (1 - skipped) * weight : torch::full({}, weight);
    for (size_t i = 0; i < averages_.size(); ++i) averages_[i].add_((sources_[i].to(torch::kFloat32) - averages_[i]) * w);
#endif
  }

  // Puts the averages into the model's own tensors (cast: bf16 under bf16-master), keeping a copy of
  // what they held for restore().
  // Under fsdp the rows themselves (collective: every rank swaps at once).
  void swap_in(Module& module) {
    torch::NoGradGuard ng;
    live_ = sharded_ ? sources_ : model_tensors(module);
    backup_.clear();
    for (size_t i = 0; i < live_.size(); ++i) {
      backup_.push_back(live_[i].clone());
      live_[i].copy_(averages_[i]);
    }
    if (sharded_) sharded_->changed();
  }
  bool swapped_in() const { return !backup_.empty(); }
  // The model's tensor of each name while swapped in (what a forward over the averages changed).
  const std::vector<torch::Tensor>& live() const { return live_; }
  void restore() {
    if (backup_.empty()) return;
    torch::NoGradGuard ng;
    for (size_t i = 0; i < live_.size(); ++i) live_[i].copy_(backup_[i]);
    backup_.clear(), live_.clear();
    if (sharded_) sharded_->changed();
  }

  // Under fsdp collective: every rank gathers the averages whole.
  void save(checkpoint::CheckpointData& d) const {
    for (size_t i = 0; i < averages_.size(); ++i)
      d.tensors[prefix_ + names_[i]] = sharded_ ? sharded_->whole(i, averages_[i]) : averages_[i];
  }
  // The checkpoint's averages, checked whole (CheckpointView::weight_averages) before any is taken;
  // false when it holds none.
  bool load(TrainerView& t, const checkpoint::CheckpointData& d) {
    bind(t);
    std::map<std::string, torch::Tensor> weights;  // under fsdp of the whole shapes
    for (size_t i = 0; i < names_.size(); ++i)
      weights.emplace(names_[i], sharded_ ? torch::empty(sharded_->whole_shape(i), sources_[i].options().device(torch::kMeta))
                                          : sources_[i]);
    const auto averages = CheckpointView(d, d.source).weight_averages(prefix_, weights);
    if (averages.empty()) return false;
    std::vector<torch::Tensor> loaded;
    for (size_t i = 0; i < names_.size(); ++i) {
      torch::Tensor a = averages.at(names_[i]).to(sources_[i].device(), torch::kFloat32);
      if (sharded_) a = sharded_->rows_of(i, a);
      loaded.push_back(a.contiguous(sources_[i].suggest_memory_format()));
    }
    averages_ = std::move(loaded);
    return true;
  }

 private:
  // The model's parameters and floating buffers in the order of names_.
  std::vector<torch::Tensor> model_tensors(Module& module) const {
    std::map<std::string, torch::Tensor> all;
    for (const auto& p : module.net().named_parameters()) all[p.key()] = p.value();
    for (const auto& b : module.net().named_buffers()) all[b.key()] = b.value();
    std::vector<torch::Tensor> out;
    for (const auto& n : names_) out.push_back(all.at(n));
    return out;
  }

  std::string prefix_;
  ShardedWeights* sharded_ = nullptr;  // under fsdp (the trainer outlives the callback's use of it)
  std::vector<std::string> names_;
  std::vector<torch::Tensor> sources_, averages_, live_, backup_;
};

}  // namespace strobe
