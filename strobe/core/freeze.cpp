#include "strobe/core/freeze.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/graph_step.h"
#include "strobe/core/master_weights.h"
#include "strobe/core/optim.h"
#include "strobe/distributed/strategy.h"

namespace strobe {
namespace {

bool matches_any(const std::vector<std::string>& globs, const std::string& name, std::vector<bool>* used) {
  bool hit = false;
  for (size_t i = 0; i < globs.size(); ++i)
    if (glob_matches(globs[i], name)) {
      hit = true;
      if (used) (*used)[i] = true;
    }
  return hit;
}

std::string joined(const std::string& prefix, const std::string& name) { return prefix.empty() ? name : prefix + "." + name; }

}  // namespace

Freeze::Freeze(const config::OptimizerConfig& cfg, torch::nn::Module& net) {
  const auto& pg = cfg.param_groups;
  unfreeze_at_ = pg.unfreeze_at_epoch;
  std::vector<bool> used(pg.freeze.size(), false);
  for (const auto& item : net.named_modules()) {
    torch::nn::Module& m = *item.value();
    const bool bn = is_batch_norm(m);
    bool bn_selected = false;
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      const std::string name = joined(item.key(), p.key());
      if (!p.value().requires_grad() || !matches_any(pg.freeze, name, &used)) continue;
      bn_selected = bn_selected || bn;
      if (bn && pg.train_bn) continue;  // Lightning's train_bn: the layer keeps training
      names_.insert(name);
      params_.push_back(p.value());
    }
    if (bn && !pg.train_bn && (bn_selected || matches_any(pg.freeze, joined(item.key(), "running_mean"), nullptr)))
      frozen_bn_.push_back(item.value());
  }
  for (size_t i = 0; i < pg.freeze.size(); ++i)
    if (!used[i]) cfg.section.fail("param_groups", fmt::format("freeze[{}] '{}' matches no trainable parameter", i, pg.freeze[i]));
  // Everything frozen: a step would have no gradient to compute (autograd: "element 0 of tensors
  // does not require grad"). Refused before training, whether or not an epoch unfreezes them.
  size_t trainable = 0;
  for (const auto& p : net.parameters()) trainable += p.requires_grad();
  if (!params_.empty() && params_.size() == trainable)
    cfg.section.fail("param_groups",
                     fmt::format("freeze selects every trainable parameter ({} tensors): {} would train nothing; leave some "
                                 "trainable (a new head, say){}",
                                 trainable, unfreeze_at_ < 0 ? "the run" : fmt::format("epochs 0 to {}", unfreeze_at_ - 1),
                                 unfreeze_at_ < 0 ? "" : ", or start the run from that epoch's weights without freeze"));
}

bool Freeze::apply(int64_t epoch) {
  const bool want = frozen_at(epoch);
  if (want == frozen_) return false;
  for (auto& p : params_) {
    p.set_requires_grad(!want);
    if (want) p.mutable_grad() = torch::Tensor();
  }
  frozen_ = want;
  return true;
}

void Freeze::update(int64_t epoch) {
  const bool was_frozen = frozen_;
  if (apply(epoch)) {
    if (strategy_ && net_) strategy_->setup_grad_sync(*net_);
    if (graphed_) graphed_->invalidate();
    if (was_frozen && rank_ == 0)
      fmt::print("strobe fit: epoch {}: unfroze {} parameter tensors (optimizer.param_groups.freeze){}\n", epoch, names_.size(),
                 graphed_ ? "; the CUDA graph is captured anew" : "");
  }
  set_modes();
}

void Freeze::set_modes() {
  if (!frozen_) return;
  for (auto& m : frozen_bn_) m->eval();
}

}  // namespace strobe
