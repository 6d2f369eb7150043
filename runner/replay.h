// strobe replay: rebuilds the experiment of a NaN capture (strobe/core/capture.h) and re-runs
// its step with the non-finite op tracer on (strobe/core/forensics.h).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/saved_config.h"
#include "strobe/core/forensics.h"
#include "strobe/data/batch.h"

namespace strobe::capture {

struct ReplayOptions {
  std::optional<std::string> device;  // cpu | cuda | cuda:<i>; default: the device it was captured on
  bool allow_changed_plugins = false;   // load a plugin whose file changed since the capture (noted in the report)
};

// A capture read and checked against its own record (CheckpointError naming what is wrong).
struct LoadedCapture {
  std::string dir, file;  // the capture directory and its capture.ckpt
  checkpoint::CheckpointData data;
  nlohmann::json info;  // the capture record
  std::vector<Batch> batches;
  std::shared_ptr<const config::SavedConfig> config;  // its resolved config, parsed once
  std::string captured_device;
  bool fp8 = false;  // captured under trainer.fp8
};
LoadedCapture load_capture(const std::string& path);
// A data-parallel capture's parts, one per rank in rank order (`cap` among them; rank 0 at
// <dir>/step_<N>, rank r at <dir>/rank<r>/step_<N>); empty for a one-process capture. A missing
// part, or one of another step, is a CheckpointError naming it.
std::vector<LoadedCapture> rank_captures(const LoadedCapture& cap);
// The device a replay runs on: --device, else the captured one (the CPU when no GPU is visible).
std::string default_replay_device(const LoadedCapture& cap, const ReplayOptions& options);

// One way of re-running the captured step.
struct ReplayVariant {
  std::string device = "cpu";
  std::optional<std::string> precision;  // another trainer.precision (replay may change it; a resume may not)
  // trainer.fp8 off for this run (the capture's otherwise); a precision float8 does not run under
  // ("32", float64) turns it off too.
  bool fp8_off = false;
  bool float64 = false;  // on the CPU, model and batches in float64, forward and backward only (no update)
  bool previous_step = false;  // the micro-batches of the step before, re-read through the training loader
  std::optional<std::vector<Batch>> batches;  // these micro-batches in place of the captured ones (--bisect's subsets)
  bool allow_changed_plugins = false;
};

// What one re-run gave: each micro-batch's loss (host), the non-finite gradients, the total gradient
// norm (NaN when not comparable: scaled under 16-mixed), the first non-finite op.
struct StepOutcome {
  std::string device;
  std::vector<torch::Tensor> losses;
  std::vector<std::string> nonfinite_grads, nonfinite_params, notes, plugin_changes;
  double grad_norm = NAN;
  std::optional<NonFiniteEvent> first;
  int64_t traced = 0;
  std::map<int64_t, std::string> sources;  // the captured rows' dataset index -> Dataset::describe (where known)
  std::vector<std::string> batch_dependent;  // modules whose training output depends on the whole batch (BatchNorm)
  bool finite() const;  // every loss, every gradient and every traced op finite
  double mean_loss() const;
};
StepOutcome replay_step(const LoadedCapture& cap, const ReplayVariant& variant);

// `strobe replay --diagnose` (docs/NAN_CAPTURE.md, "Diagnose"): the step as captured (twice), in
// fp32, in float64 on the CPU (models up to kFloat64MaxParams parameters), and the previous step's
// batch with the captured weights; one verdict (not reproducible | precision | data | loss |
// weights | undetermined) with its evidence.
inline constexpr int64_t kFloat64MaxParams = 30'000'000;
nlohmann::json diagnose_capture(const std::string& path, const ReplayOptions& options);
std::string format_diagnosis(const nlohmann::json& report);

// `strobe replay --bisect` (docs/NAN_CAPTURE.md, "Bisect"): a minimal set of the captured step's rows
// that keeps it bad (the first non-finite op's rows tried first, then delta debugging over rows),
// confirmed by replaying the step without them; each named by dataset index, split and source.
// With `quarantine`, those samples are added to that file (data.exclude reads it).
struct BisectOptions {
  ReplayOptions replay;
  std::string quarantine;  // --write-quarantine FILE
  bool replace_quarantine = false;  // --overwrite: an existing file that is not a quarantine file is replaced
};
nlohmann::json bisect_capture(const std::string& path, const BisectOptions& options);
std::string format_bisection(const nlohmann::json& report);

// The quarantine file (JSON: {"strobe_quarantine": 1, "samples": [{split, index, source, capture}]}):
// `samples` (with split, dataset_index, source) are added to it, atomically; an existing file must be
// one (ConfigError otherwise) unless `replace_other`, which starts a new one in its place. Returns
// {path, added, total}.
nlohmann::json write_quarantine(const std::string& path, const nlohmann::json& samples, const std::string& capture_dir,
                                bool replace_other = false);
// Whether `j` is a report `strobe replay --report` wrote (its "strobe_replay_report" marker is 1).
bool is_replay_report(const nlohmann::json& j);

// Re-runs the captured step. The report (JSON) holds: capture, step/epoch/batch indices, devices,
// exact (same loss bits and same set of non-finite gradients as when captured), the loss and
// gradient comparisons, first_nonfinite (op, module, phase, input/output statistics; null when the
// replayed step stayed finite) and notes. Throws checkpoint::CheckpointError / config::ConfigError
// for a path that is not a capture or a config this build cannot construct.
nlohmann::json replay_capture(const std::string& path, const ReplayOptions& options);

// The human-readable rendering of a replay report.
std::string format_replay_report(const nlohmann::json& report);

}  // namespace strobe::capture
