// The typed experiment: top-level keys and the trainer section are validated here (no torch);
// component sections (task, model, data, optimizer, scheduler, callbacks) are handed to the
// registered component factories, which read and finish() them.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "strobe/config/config.h"
#include "strobe/config/precision.h"

namespace strobe::config {

// trainer.profiler: a Chrome/TensorBoard trace of training steps first..last (1-based optimizer
// steps, the numbering of metrics.csv), written by the profiler callback (callbacks/profiler.h).
struct ProfilerConfig {
  bool enabled = false;
  int64_t first_step = 20, last_step = 25;
  std::string path;  // "" = <run_dir>/profiler
  bool record_shapes = false;
};

struct TrainerConfig {
  int64_t max_epochs = 1;  // -1: unlimited
  int64_t max_steps = -1;  // optimizer steps; -1: unlimited
  std::optional<double> max_time_s;
  Precision precision = Precision::k32;  // trainer.precision (docs/CONFIG.md)
  int64_t accumulate_grad_batches = 1;
  double gradient_clip_val = 0.0;
  std::string gradient_clip_algorithm = "norm";
  CountOrFraction val_check_interval{false, 0, 1.0};
  int64_t check_val_every_n_epoch = 1;
  int64_t num_sanity_val_steps = 2;
  CountOrFraction limit_train_batches{false, 0, 1.0};
  CountOrFraction limit_val_batches{false, 0, 1.0};
  CountOrFraction limit_test_batches{false, 0, 1.0};
  CountOrFraction limit_predict_batches{false, 0, 1.0};
  CountOrFraction overfit_batches{false, 0, 0.0};
  int64_t fast_dev_run = 0;  // n > 0: run n train/val/test batches, no checkpoints or logs
  int64_t log_every_n_steps = 50;
  std::string device = "auto";
  bool deterministic = false;
  std::string default_root_dir = "runs";
  bool enable_progress_bar = true;
  bool enable_checkpointing = true;
  ProfilerConfig profiler;
  // Whole-step CUDA graphs (forward, backward, step pipeline, optimizer) replayed for batches of the
  // captured shape (docs/ARCHITECTURE.md "CUDA graphs"): false | true (or an error saying why not) |
  // auto (on wherever it applies: a CUDA device, one process, no accumulation, the fused optimizer).
  std::string cuda_graphs = "false";
  // Multi-process runs: the longest a rendezvous, a host decision or a collective may wait for a
  // peer before every process ends with one line (docs/DISTRIBUTED.md). Seconds.
  double dist_timeout_s = 600.0;
};

struct LoggerConfig {
  bool csv = true;
  bool tensorboard = false;
};

// model.init_from: weights a fit starts from (and validate/test evaluate without --ckpt), read from a
// safetensors file after the model is built (docs/MODELS.md "Pretrained weights").
// `init_from: FILE` alone is {path: FILE} with the defaults below.
struct InitFrom {
  std::string path;
  std::string names = "strobe";      // the file's naming: strobe | timm | torchvision | ... (per model)
  bool strict = true;                // false: what does not fit is listed as a warning, the rest loads
  std::vector<std::string> ignore;   // globs over the file's names (and the model's names as the file spells them)
};

// Reads model.init_from when it is present (the scalar form is rewritten into the mapping, so the
// resolved config shows every key) and marks the key as known to the model section.
std::optional<InitFrom> parse_init_from(Section& model);

// One entry of `plugins:`. A plain entry is a path; the resolved config writes each loaded plugin as
// {path, sha256} (its content hash when it was loaded), so whatever loads that config again — resume,
// validate, test, replay — refuses a changed file instead of running other code silently.
struct PluginSpec {
  std::string path;             // absolute
  std::string sha256;           // the hash recorded for it; empty: none recorded
  std::string recorded_by;      // where that hash was recorded (a config file or a checkpoint)
  std::string replaced_sha256;  // a run that went on with a changed plugin (--allow-changed-plugins): the hash before
  std::string listed_at;        // "FILE:LINE:COL: plugins[i]" for an entry of a config's `plugins:` list

  bool operator==(const PluginSpec& o) const { return path == o.path && sha256 == o.sha256; }
};

struct Experiment {
  std::string name = "experiment";
  int64_t seed = 0;
  TrainerConfig trainer;
  LoggerConfig logger;
  Section task, model, data, optimizer, scheduler;
  std::vector<Section> callbacks;
  std::optional<InitFrom> init_from;  // model.init_from
  // `plugins:` (and --plugin): component libraries to load before anything is built, as absolute
  // paths (a relative one is taken from the config file's directory; the resolved config stores these).
  std::vector<PluginSpec> plugins;
};

// The `plugins:` a resolved config (a checkpoint's or a capture's) recorded; `source` names it in
// errors and in recorded_by. Throws ConfigError for an entry that is neither a path nor {path, sha256}.
std::vector<PluginSpec> recorded_plugins(const std::string& resolved_yaml, const std::string& source);

// "DD:HH:MM:SS" (or fewer fields, "HH:MM:SS", "MM:SS", "SS") into seconds; nullopt on bad syntax.
std::optional<double> parse_duration(const std::string& text);

// Validates the top level and the trainer section of `doc`; throws ConfigError.
Experiment parse_experiment(Document& doc);

}  // namespace strobe::config
