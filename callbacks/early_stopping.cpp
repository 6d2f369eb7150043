// early_stopping: stops fit when the monitored validation metric has not improved by min_delta for
// `patience` validation runs (or is not finite, or crosses stopping/divergence thresholds). Reads the
// value after the validation epoch's metrics were delivered — one wait per validation, none per step.
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/core/callback.h"
#include "strobe/core/trainer_view.h"

namespace strobe {
namespace {

class EarlyStopping : public Callback {
 public:
  EarlyStopping(std::string monitor, std::string mode, int64_t patience, double min_delta, bool check_finite,
                std::optional<double> stop_at, std::optional<double> diverge_at)
      : monitor_(std::move(monitor)), max_(mode == "max"), patience_(patience), min_delta_(min_delta),
        check_finite_(check_finite), stop_at_(stop_at), diverge_at_(diverge_at) {}
  std::string name() const override { return "early_stopping"; }
  std::string state_key() const override { return fmt::format("early_stopping[monitor={},mode={}]", monitor_, max_ ? "max" : "min"); }

  void on_validation_end(TrainerView& t, Module&) override {
    if (t.sanity_checking()) return;
    auto it = t.metrics().find(monitor_);
    if (it == t.metrics().end())
      throw std::runtime_error(fmt::format("early_stopping: monitor '{}' was not logged during validation", monitor_));
    double v = it->second;
    std::string why;
    if (check_finite_ && !std::isfinite(v)) {
      why = fmt::format("{} is not finite", monitor_);
    } else if (stop_at_ && (max_ ? v >= *stop_at_ : v <= *stop_at_)) {
      why = fmt::format("{} reached the stopping threshold {}", monitor_, *stop_at_);
    } else if (diverge_at_ && (max_ ? v <= *diverge_at_ : v >= *diverge_at_)) {
      why = fmt::format("{} crossed the divergence threshold {}", monitor_, *diverge_at_);
    } else if (!has_best_ || (max_ ? v > best_ + min_delta_ : v < best_ - min_delta_)) {
      best_ = v, has_best_ = true, wait_ = 0;
    } else if (++wait_ >= patience_) {
      why = fmt::format("{} did not improve by {} for {} validations (best {:.6g})", monitor_, min_delta_, patience_, best_);
    }
    if (!why.empty()) {
      stopped_step_ = t.state().global_step;
      if (t.is_global_zero()) fmt::print(stderr, "early_stopping: {}; stopping at step {}\n", why, stopped_step_);
      t.request_stop();
    }
  }

  nlohmann::json state_dict() const override {
    return {{"wait", wait_}, {"best", best_}, {"has_best", has_best_}, {"stopped_step", stopped_step_}};
  }
  void load_state_dict(const nlohmann::json& s) override {
    wait_ = s.at("wait").get<int64_t>(), best_ = s.at("best").get<double>();
    has_best_ = s.at("has_best").get<bool>(), stopped_step_ = s.at("stopped_step").get<int64_t>();
  }

 private:
  std::string monitor_;
  bool max_;
  int64_t patience_;
  double min_delta_;
  bool check_finite_;
  std::optional<double> stop_at_, diverge_at_;
  int64_t wait_ = 0, stopped_step_ = -1;
  double best_ = 0;
  bool has_best_ = false;
};

std::shared_ptr<Callback> make_early_stopping(config::Section& cfg) {
  std::string monitor = cfg.get_string("monitor", "val/loss");
  std::string mode = cfg.get_choice("mode", "min", {"min", "max"});
  int64_t patience = cfg.get_int("patience", 3, 1);
  double min_delta = cfg.get_double("min_delta", 0.0, 0.0);
  bool check_finite = cfg.get_bool("check_finite", true);
  std::optional<double> stop_at, diverge_at;
  if (!cfg.is_null("stopping_threshold")) stop_at = cfg.get_double("stopping_threshold", 0.0);
  else cfg.accept("stopping_threshold");
  if (!cfg.is_null("divergence_threshold")) diverge_at = cfg.get_double("divergence_threshold", 0.0);
  else cfg.accept("divergence_threshold");
  cfg.finish();
  return std::make_shared<EarlyStopping>(monitor, mode, patience, min_delta, check_finite, stop_at, diverge_at);
}

STROBE_REGISTER(callback_registry(), "early_stopping", make_early_stopping);

}  // namespace
}  // namespace strobe
