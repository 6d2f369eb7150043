// The thresholds a spike capture recorded (docs/NAN_CAPTURE.md, "Spikes"): for each metric the
// window's mean + zscore x std at the captured step. Shared by replay (which rank is at fault) and
// diagnose/bisect (which replayed step or sample is bad).
#pragma once

#include <cmath>

#include <nlohmann/json.hpp>

namespace strobe::capture {

// NaN: the metric is not used (not a spike capture, or the metric was not watched).
struct SpikeThresholds {
  double loss = NAN, grad_norm = NAN;
};

inline SpikeThresholds spike_thresholds(const nlohmann::json& info) {
  SpikeThresholds t;
  if (info.value("kind", "") != "spike" || !info.contains("spike")) return t;
  const auto& s = info["spike"];
  const double z = s.value("zscore", 6.0);
  auto one = [&](const char* k) -> double {
    if (!s.contains(k) || !s[k].is_object()) return NAN;
    return s[k].value("mean", 0.0) + z * s[k].value("std", 0.0);
  };
  t.loss = one("loss");
  t.grad_norm = one("grad_norm");
  return t;
}

}  // namespace strobe::capture
