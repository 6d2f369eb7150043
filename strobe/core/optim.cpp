#include "strobe/core/optim.h"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/checkpoint_keys.h"
#include "strobe/core/loop_state.h"

#if STROBE_HAS_OPS
#include "strobe/ops/fused_optimizers.h"
#include "strobe/ops/ops.h"
#endif

namespace strobe {

bool glob_matches(const std::string& glob, const std::string& name) { return ::fnmatch(glob.c_str(), name.c_str(), 0) == 0; }

std::vector<ParamGroup> make_param_groups(const config::OptimizerConfig& cfg,
                                          const std::vector<std::pair<std::string, torch::Tensor>>& named,
                                          const Model* model, const std::set<std::string>& frozen) {
  const auto& pg = cfg.param_groups;
  const size_t n = pg.groups.size();
  // The default group's layers: one without layer_decay.
  size_t layers = 1;
  if (pg.layer_decay) {
    if (!model || model->num_layers() <= 0)
      cfg.section.fail("param_groups", fmt::format("layer_decay needs a model that declares its depth order (vit, llama, "
                                                   "decoder_lm, resnet); {} does not",
                                                   model ? "model '" + model->name() + "'" : "this task's network"));
    // A model's declared depth (a plugin's num_layers()) is checked before a group is made for each layer.
    if (model->num_layers() > static_cast<int64_t>(named.size()) + 1)
      cfg.section.fail("param_groups", fmt::format("layer_decay: model '{}' declares {} layers (num_layers()), more than its {} "
                                                   "parameter tensors could fill: its num_layers() is wrong",
                                                   model->name(), model->num_layers(), named.size()));
    layers = static_cast<size_t>(model->num_layers());
  }
  const std::vector<std::string> model_no_decay = model ? model->no_weight_decay() : std::vector<std::string>{};
  // Buckets: 4 per configured group, then the default's 4 per layer: decayed, no_decay, and the
  // frozen ones of each (at unfreeze_lr_scale x the lr).
  std::vector<ParamGroup> buckets(4 * (n + layers));
  std::vector<bool> group_used(n, false), glob_used(pg.no_decay.size(), false);
  for (size_t g = 0; g < n + layers; ++g) {
    const bool configured = g < n;
    std::string base = configured ? fmt::format("groups[{}]", g) : "default";
    double lr = configured && pg.groups[g].lr ? *pg.groups[g].lr : cfg.lr, scale = 1;
    const double wd = configured && pg.groups[g].weight_decay ? *pg.groups[g].weight_decay : cfg.weight_decay;
    if (!configured && pg.layer_decay) {
      const size_t layer = g - n;
      base += fmt::format("/layer_{}", layer);
      scale = std::pow(*pg.layer_decay, static_cast<double>(layers - 1 - layer));
    }
    const double fs = pg.unfreeze_lr_scale;
    buckets[4 * g] = ParamGroup{base, {}, {}, lr * scale, wd, scale};
    buckets[4 * g + 1] = ParamGroup{base + "/no_decay", {}, {}, lr * scale, 0.0, scale};
    buckets[4 * g + 2] = ParamGroup{base + "/frozen", {}, {}, lr * scale * fs, wd, scale * fs};
    buckets[4 * g + 3] = ParamGroup{base + "/no_decay/frozen", {}, {}, lr * scale * fs, 0.0, scale * fs};
  }
  for (const auto& [name, p] : named) {
    size_t g = n;
    bool configured = false;
    for (size_t i = 0; i < n; ++i)
      if (glob_matches(pg.groups[i].params, name)) {
        g = i, group_used[i] = true, configured = true;
        break;
      }
    if (!configured && pg.layer_decay) {
      const int64_t layer = model->layer_of(name);
      if (layer < 0 || layer >= static_cast<int64_t>(layers))
        cfg.section.fail("param_groups", fmt::format("layer_decay: model '{}' puts parameter '{}' in layer {} (layer_of()), "
                                                     "outside [0, {}) of its num_layers()",
                                                     model->name(), name, layer, layers));
      g = n + static_cast<size_t>(layer);
    }
    bool no_decay = pg.no_decay_auto &&
                    (p.dim() <= 1 || std::find(model_no_decay.begin(), model_no_decay.end(), name) != model_no_decay.end());
    for (size_t i = 0; i < pg.no_decay.size(); ++i)
      if (glob_matches(pg.no_decay[i], name)) no_decay = true, glob_used[i] = true;
    auto& b = buckets[4 * g + (no_decay ? 1 : 0) + (frozen.count(name) ? 2 : 0)];
    b.names.push_back(name);
    b.params.push_back(p);
  }
  for (size_t i = 0; i < n; ++i)
    if (!group_used[i])
      cfg.section.fail("param_groups", fmt::format("groups[{}].params '{}' matches no trainable parameter (or only ones an "
                                                   "earlier group took)",
                                                   i, pg.groups[i].params));
  for (size_t i = 0; i < pg.no_decay.size(); ++i)
    if (!glob_used[i])
      cfg.section.fail("param_groups", fmt::format("no_decay[{}] '{}' matches no trainable parameter", i, pg.no_decay[i]));
  std::vector<ParamGroup> out;
  // The default group(s) first, as the only group of a config without param_groups.
  for (size_t k = 4 * n; k < buckets.size(); ++k)
    if (!buckets[k].params.empty()) out.push_back(std::move(buckets[k]));
  for (size_t k = 0; k < 4 * n; ++k)
    if (!buckets[k].params.empty()) out.push_back(std::move(buckets[k]));
  return out;
}

std::string describe_param_groups(const std::vector<ParamGroup>& groups) {
  // The name column is as wide as the longest name, so that every row's columns line up.
  size_t w = 5;
  for (const auto& g : groups) w = std::max(w, g.name.size());
  std::string out = fmt::format("{:<{}} {:>8} {:>12} {:>12} {:>12}\n", "group", w, "tensors", "lr", "lr_scale", "weight_decay");
  for (const auto& g : groups) {
    int64_t numel = 0;
    for (const auto& p : g.params) numel += p.numel();
    out += fmt::format("{:<{}} {:>8} {:>12.6g} {:>12.6g} {:>12.6g}  ({} parameters)\n", g.name, w, g.params.size(), g.lr,
                       g.lr_scale, g.weight_decay, numel);
  }
  for (const auto& g : groups) {
    out += fmt::format("\n[{}]\n", g.name);
    for (const auto& n : g.names) out += n + "\n";
  }
  return out;
}

std::shared_ptr<torch::optim::Optimizer> build_optimizer(const config::OptimizerConfig& cfg, const std::vector<ParamGroup>& groups,
                                                         const torch::Device& device) {
  std::vector<torch::Tensor> params;
  for (const auto& g : groups) params.insert(params.end(), g.params.begin(), g.params.end());
  std::string why_not;
#if STROBE_HAS_OPS
  if (!device.is_cuda()) why_not = fmt::format("the device is {}, and the fused step runs on CUDA", device.str());
  else if (!ops::built_with_cuda()) why_not = "this build's custom operators have no CUDA kernels";
  // Dense fp32 (channels_last included: the kernels walk parameter, state and gradient memory flat).
  for (const auto& p : params)
    if (why_not.empty() && (p.scalar_type() != torch::kFloat32 || !p.is_non_overlapping_and_dense()))
      why_not = fmt::format("it needs dense fp32 parameters (found {}{})", c10::toString(p.scalar_type()),
                            p.is_non_overlapping_and_dense() ? "" : ", a strided view");
#else
  why_not = "this build has no custom operators";
#endif
  if (cfg.fused == "true" && !why_not.empty())
    cfg.section.fail("fused", fmt::format("the fused optimizer step is not available: {} (use fused: auto or false)", why_not));
  const bool use_fused = cfg.fused != "false" && why_not.empty();
  // One torch::optim group per ParamGroup, each with the section's options and its own lr and decay.
  std::shared_ptr<torch::optim::Optimizer> opt;
  auto make_groups = [&](const auto& base) {
    std::vector<torch::optim::OptimizerParamGroup> out;
    for (const auto& g : groups) {
      auto o = std::make_unique<std::decay_t<decltype(base)>>(base);
      o->lr(g.lr);
      o->weight_decay(g.weight_decay);
      out.emplace_back(g.params, std::move(o));
    }
    return out;
  };
  if (cfg.name == "sgd") {
    auto o = torch::optim::SGDOptions(cfg.lr)
                 .momentum(cfg.momentum)
                 .nesterov(cfg.nesterov)
                 .dampening(cfg.dampening)
                 .weight_decay(cfg.weight_decay);
#if STROBE_HAS_OPS
    if (use_fused) opt = std::make_shared<ops::FusedSGD>(make_groups(o), o);
#endif
    if (!opt) opt = std::make_shared<torch::optim::SGD>(make_groups(o), o);
  } else if (cfg.name == "adam") {
    auto o = torch::optim::AdamOptions(cfg.lr)
                 .betas({cfg.beta1, cfg.beta2})
                 .eps(cfg.eps)
                 .weight_decay(cfg.weight_decay)
                 .amsgrad(cfg.amsgrad);
#if STROBE_HAS_OPS
    if (use_fused) opt = std::make_shared<ops::FusedAdam>(make_groups(o), o);
#endif
    if (!opt) opt = std::make_shared<torch::optim::Adam>(make_groups(o), o);
  } else {
    auto o = torch::optim::AdamWOptions(cfg.lr)
                 .betas({cfg.beta1, cfg.beta2})
                 .eps(cfg.eps)
                 .weight_decay(cfg.weight_decay)
                 .amsgrad(cfg.amsgrad);
#if STROBE_HAS_OPS
    if (use_fused) opt = std::make_shared<ops::FusedAdamW>(make_groups(o), o);
#endif
    if (!opt) opt = std::make_shared<torch::optim::AdamW>(make_groups(o), o);
  }
  return opt;
}

double get_lr(const torch::optim::Optimizer& opt, size_t group) {
  return opt.param_groups().at(group).options().get_lr();
}

void set_lr(torch::optim::Optimizer& opt, size_t group, double lr) {
  opt.param_groups().at(group).options().set_lr(lr);
}

LRScheduler::LRScheduler(torch::optim::Optimizer& opt) : opt_(opt) {
  for (size_t g = 0; g < opt.param_groups().size(); ++g) base_lrs_.push_back(get_lr(opt, g));
}

void LRScheduler::apply() {
  if (!override_.empty()) {
    for (size_t g = 0; g < override_.size(); ++g) set_lr(opt_, g, override_[g]);
    return;
  }
  double f = factor(step_);
  // Each group at its own base lr times the factor, never below the floor (reduce_on_plateau's
  // min_lr, for every group alike; a group whose base lr is below it stays at its base).
  for (size_t g = 0; g < base_lrs_.size(); ++g)
    set_lr(opt_, g, std::max(base_lrs_[g] * f, std::min(lr_floor(), base_lrs_[g])));
}

void LRScheduler::set_override(std::vector<double> lrs) {
  if (lrs.size() != base_lrs_.size())
    throw std::logic_error(fmt::format("LRScheduler::set_override: {} lrs for {} parameter groups", lrs.size(), base_lrs_.size()));
  override_ = std::move(lrs);
  apply();
}

void LRScheduler::clear_override() {
  override_.clear();
  apply();
}

void LRScheduler::step(int64_t global_step) {
  step_ = global_step;
  apply();
}

nlohmann::json LRScheduler::state_dict() const {
  nlohmann::json s = {{"step", step_}, {"base_lrs", base_lrs_}};
  if (length() >= 0) s["length"] = length();
  return s;
}

void LRScheduler::load_state_dict(const nlohmann::json& s) {
  step_ = s.at("step").get<int64_t>();
  base_lrs_ = s.at("base_lrs").get<std::vector<double>>();
  saved_length_ = s.contains("length") ? s.at("length").get<int64_t>() : -1;
  apply();
}

namespace {

class StepLR : public LRScheduler {
 public:
  StepLR(torch::optim::Optimizer& o, int64_t step_size, double gamma) : LRScheduler(o), size_(step_size), gamma_(gamma) {}
  double factor(int64_t s) const override { return std::pow(gamma_, static_cast<double>(s / size_)); }
  int64_t size_;
  double gamma_;
};

class MultiStepLR : public LRScheduler {
 public:
  MultiStepLR(torch::optim::Optimizer& o, std::vector<int64_t> m, double gamma) : LRScheduler(o), m_(std::move(m)), gamma_(gamma) {}
  double factor(int64_t s) const override {
    int n = 0;
    for (auto x : m_) n += s >= x;
    return std::pow(gamma_, n);
  }
  std::vector<int64_t> m_;
  double gamma_;
};

// Linear warmup from warmup_start_factor to 1 over warmup_steps, then cosine to min_factor at
// total_steps (constant afterwards).
class CosineWarmup : public LRScheduler {
 public:
  CosineWarmup(torch::optim::Optimizer& o, int64_t warmup, int64_t total, double start, double min_factor)
      : LRScheduler(o), warmup_(warmup), total_(total), start_(start), min_(min_factor) {}
  double factor(int64_t s) const override {
    if (s < warmup_) return start_ + (1.0 - start_) * static_cast<double>(s) / static_cast<double>(warmup_);
    if (total_ <= warmup_) return 1.0;
    double p = std::min(1.0, static_cast<double>(s - warmup_) / static_cast<double>(total_ - warmup_));
    return min_ + (1.0 - min_) * 0.5 * (1.0 + std::cos(M_PI * p));
  }
  int64_t length() const override { return total_; }
  void set_length(int64_t steps) override { total_ = steps; }
  int64_t warmup_, total_;
  double start_, min_;
};

class LinearWarmup : public LRScheduler {
 public:
  LinearWarmup(torch::optim::Optimizer& o, int64_t warmup, double start) : LRScheduler(o), warmup_(warmup), start_(start) {}
  double factor(int64_t s) const override {
    if (s >= warmup_) return 1.0;
    return start_ + (1.0 - start_) * static_cast<double>(s) / static_cast<double>(warmup_);
  }
  int64_t warmup_;
  double start_;
};

// The learning-rate range test's schedule (strobe tune lr; Lightning's lr_find): the lr grows
// exponentially from its base to base x end_factor over `steps` optimizer steps, as Lightning's
// exponential schedule does it: step 0 at the base, step s >= 1 at base x end_factor^((s + 1) / steps),
// so the last step (steps - 1) is at base x end_factor.
class LrRange : public LRScheduler {
 public:
  LrRange(torch::optim::Optimizer& o, double end_factor, int64_t steps) : LRScheduler(o), end_(end_factor), steps_(steps) {}
  double factor(int64_t s) const override {
    if (s <= 0) return 1.0;
    return std::pow(end_, static_cast<double>(std::min(s + 1, steps_)) / static_cast<double>(steps_));
  }
  double end_;
  int64_t steps_;
};

// Multiplies the lr by `factor` after `patience` validations without improvement of the monitored
// value (relative threshold, as torch's default 'rel' mode), then waits `cooldown` validations.
class ReduceOnPlateau : public LRScheduler {
 public:
  ReduceOnPlateau(torch::optim::Optimizer& o, std::string monitor, bool maximize, double factor, int64_t patience,
                  double threshold, int64_t cooldown, double min_lr)
      : LRScheduler(o), monitor_(std::move(monitor)), max_(maximize), f_(factor), patience_(patience),
        threshold_(threshold), cooldown_(cooldown), min_lr_(min_lr) {}
  double factor(int64_t) const override { return scale_; }
  double lr_floor() const override { return min_lr_; }
  bool wants_monitor() const override { return true; }
  std::string monitor() const override { return monitor_; }
  void on_validation_end(double v) override {
    bool better = !has_best_ || (max_ ? v > best_ * (1 + (best_ >= 0 ? threshold_ : -threshold_))
                                      : v < best_ * (1 - (best_ >= 0 ? threshold_ : -threshold_)));
    if (std::isnan(v)) better = false;
    if (better) {
      best_ = v, has_best_ = true, bad_ = 0;
    } else {
      ++bad_;
    }
    if (cooldown_left_ > 0) {
      --cooldown_left_;
      bad_ = 0;
    }
    if (bad_ > patience_) {
      // Not below the smallest scale any group can still use above min_lr (apply() floors each).
      double max_base = 0;
      for (double b : base_lrs_) max_base = std::max(max_base, b);
      scale_ = std::max(scale_ * f_, max_base <= 0 ? 0.0 : min_lr_ / max_base);
      cooldown_left_ = cooldown_;
      bad_ = 0;
      apply();
    }
  }
  nlohmann::json state_dict() const override {
    auto s = LRScheduler::state_dict();
    s["best"] = best_, s["has_best"] = has_best_, s["bad"] = bad_, s["scale"] = scale_, s["cooldown_left"] = cooldown_left_;
    return s;
  }
  void load_state_dict(const nlohmann::json& s) override {
    best_ = s.at("best").get<double>(), has_best_ = s.at("has_best").get<bool>(), bad_ = s.at("bad").get<int64_t>();
    scale_ = s.at("scale").get<double>(), cooldown_left_ = s.at("cooldown_left").get<int64_t>();
    LRScheduler::load_state_dict(s);
  }
  std::string monitor_;
  bool max_;
  double f_;
  int64_t patience_;
  double threshold_;
  int64_t cooldown_;
  double min_lr_;
  double best_ = 0, scale_ = 1.0;
  bool has_best_ = false;
  int64_t bad_ = 0, cooldown_left_ = 0;
};

}  // namespace

std::shared_ptr<LRScheduler> build_scheduler(const config::SchedulerConfig& cfg, torch::optim::Optimizer& opt,
                                             int64_t total_steps) {
  std::shared_ptr<LRScheduler> s;
  if (cfg.name == "step") {
    s = std::make_shared<StepLR>(opt, cfg.step_size, cfg.gamma);
  } else if (cfg.name == "multistep") {
    s = std::make_shared<MultiStepLR>(opt, cfg.milestones, cfg.gamma);
  } else if (cfg.name == "cosine") {
    const int64_t total = cfg.max_steps > 0 ? cfg.max_steps : total_steps;
    if (total <= 0)
      cfg.section.fail("max_steps", "cosine needs the run length: set scheduler.max_steps or trainer.max_steps");
    s = std::make_shared<CosineWarmup>(opt, cfg.warmup_steps, total, cfg.warmup_start_factor, cfg.min_lr_factor);
  } else if (cfg.name == "linear_warmup") {
    s = std::make_shared<LinearWarmup>(opt, cfg.warmup_steps, cfg.warmup_start_factor);
  } else if (cfg.name == "lr_range") {
    s = std::make_shared<LrRange>(opt, cfg.end_factor, cfg.range_steps);
  } else if (cfg.name == "reduce_on_plateau") {
    s = std::make_shared<ReduceOnPlateau>(opt, cfg.monitor, cfg.mode_max, cfg.factor, cfg.patience, cfg.threshold,
                                          cfg.cooldown, cfg.min_lr);
  }
  if (s) s->apply();
  return s;
}

void LRScheduler::save(checkpoint::CheckpointData& d, const StepStart* at) {
  nlohmann::json s = state_dict();
  if (at) s["step"] = at->loop.global_step;
  d.blobs[checkpoint_keys::kScheduler] = s.dump();
}

void LRScheduler::load(const checkpoint::CheckpointData& d) {
  if (d.has_blob(checkpoint_keys::kScheduler)) load_state_dict(nlohmann::json::parse(d.blob(checkpoint_keys::kScheduler)));
}

}  // namespace strobe
