// strobe replay: rebuilds the experiment of a NaN capture (strobe/core/capture.h) and re-runs
// its step with the non-finite op tracer on (strobe/core/forensics.h).
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace strobe::capture {

struct ReplayOptions {
  std::optional<std::string> device;  // cpu | cuda | cuda:<i>; default: the device it was captured on
  bool allow_changed_plugins = false;   // load a plugin whose file changed since the capture (noted in the report)
};

// Re-runs the captured step. The report (JSON) holds: capture, step/epoch/batch indices, devices,
// exact (same loss bits and same set of non-finite gradients as when captured), the loss and
// gradient comparisons, first_nonfinite (op, module, phase, input/output statistics; null when the
// replayed step stayed finite) and notes. Throws checkpoint::CheckpointError / config::ConfigError
// for a path that is not a capture or a config this build cannot construct.
nlohmann::json replay_capture(const std::string& path, const ReplayOptions& options);

// The human-readable rendering of a replay report.
std::string format_replay_report(const nlohmann::json& report);

}  // namespace strobe::capture
