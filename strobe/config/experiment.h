// The typed experiment: top-level keys and the trainer, logger, optimizer and scheduler sections
// are validated here (no torch), so the resolved config is whole before anything is built; component
// sections (task, model, data, callbacks) are handed to the registered component factories, which
// read and finish() them.
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

// trainer.fp8 (docs/CONFIG.md "Float8 training"): the GEMMs of the model's float8-capable linear
// layers (Model::fp8_layers) in float8, those a `skip` glob names and those smaller than min_size
// elements left as they are. Checked against the model and the device when the trainer is built
// (strobe/core/fp8.h).
struct Fp8Config {
  bool enabled = false;
  std::vector<std::string> skip;          // globs over the layers' module paths ("layers.*.self_attn.k_proj")
  int64_t min_size = 3072 * 1024;         // the smallest weight (out x in elements) that runs in float8
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
  // val_check_interval given as a duration ("DD:HH:MM:SS", as max_time): validate after the first
  // optimizer step that ends this many seconds of training after the last validation (docs/CONFIG.md).
  std::optional<double> val_check_interval_s;
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
  bool enable_model_summary = true;
  // Before a fit claims its run directory, measure its training step's memory on a small trial and
  // refuse a data.batch_size that cannot fit (runner/step_memory.h); false skips the trial.
  bool memory_check = true;
  ProfilerConfig profiler;
  // Whole-step CUDA graphs (forward, backward, step pipeline, optimizer) replayed for batches of the
  // captured shape (docs/ARCHITECTURE.md "CUDA graphs"): false | true (or an error saying why not) |
  // auto (on wherever it applies: a CUDA device, one process, no accumulation, the fused optimizer).
  std::string cuda_graphs = "false";
  // Multi-process runs: the longest a rendezvous, a host decision or a collective may wait for a
  // peer before every process ends with one line (docs/DISTRIBUTED.md). Seconds.
  double dist_timeout_s = 600.0;
  // Multi-process runs: ddp (every rank holds the whole optimizer state) or zero2 (the optimizer's
  // fp32 values, moments and reduced gradients sharded across the ranks); auto is ddp. One process
  // trains on its device whatever this says (docs/DISTRIBUTED.md).
  std::string strategy = "auto";
  // trainer.strategy fsdp: a block's unit frees its gathered parameters after the forward and
  // gathers them again for the backward (true), or keeps them until the backward (false: one
  // all-gather less per block and step, the block's parameters held whole in between).
  bool reshard_after_forward = true;
  Fp8Config fp8;
};

// logger.mlflow (docs/CONFIG.md "logger"): an MLflow tracking server's REST API.
struct MlflowConfig {
  std::string tracking_uri;     // http(s)://host:port of `mlflow server`
  std::string experiment_name;  // created when the server has none of that name (default: the config's name)
  std::string run_name;         // "" : the run directory's name
  std::vector<std::pair<std::string, std::string>> tags;
  bool unreachable_is_error = false;  // on_unreachable: error (exit 2 before training) | warn (train and spool)
  double flush_timeout_s = 30;        // at the end, how long the unsent values may take before they are spooled
  double request_timeout_s = 10;      // one HTTP request
};

struct LoggerConfig {
  bool csv = true;
  bool tensorboard = false;
  std::optional<MlflowConfig> mlflow;
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

// optimizer: (docs/CONFIG.md). Built at fit (strobe/core/optim.h: build_optimizer), where what
// needs the device or the parameters is checked (fused: true).
// optimizer.param_groups (docs/CONFIG.md): which parameters get other hyper-parameters. Absent: one
// group, every parameter decayed (as before it existed).
struct ParamGroupSpec {
  std::string params;                   // a glob over parameter names ("head.*")
  std::optional<double> lr, weight_decay;  // unset: the optimizer's
};
struct ParamGroupsConfig {
  // no_decay: "auto" (timm's rule: parameters with at most one dimension, and the names the model
  // declares, Model::no_weight_decay) or globs; those get weight decay 0.
  bool no_decay_auto = false;
  std::vector<std::string> no_decay;
  std::vector<ParamGroupSpec> groups;  // first match wins; the rest stay in the default group
  // layer_decay: the default group's lr scaled by decay^(L - 1 - layer) over the model's depth
  // order (Model::num_layers / layer_of; timm's param_groups_layer_decay). Unset: no scaling.
  std::optional<double> layer_decay;
  // freeze: globs over parameter names, trained from the start of epoch unfreeze_at_epoch (-1:
  // never) at unfreeze_lr_scale x their group's lr; train_bn: BatchNorm layers among them keep
  // training (Lightning's BackboneFinetuning default) or, false, are frozen and run in eval mode.
  std::vector<std::string> freeze;
  int64_t unfreeze_at_epoch = -1;
  double unfreeze_lr_scale = 0.1;
  bool train_bn = true;
};

struct OptimizerConfig {
  std::string name = "adamw";  // sgd | adam | adamw
  double lr = 1e-3;
  double weight_decay = 0.01;  // the default is 0.01 for adamw, 0 for sgd and adam
  std::string fused = "auto";  // auto | true | false
  double momentum = 0.0, dampening = 0.0;  // sgd
  bool nesterov = false;                   // sgd
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adam, adamw
  bool amsgrad = false;                           // adam, adamw
  ParamGroupsConfig param_groups;
  Section section;  // where it was written, for the errors found at fit
};

// scheduler: (docs/CONFIG.md). Built at fit (build_scheduler), where cosine's run length is known.
struct SchedulerConfig {
  std::string name = "none";  // none | step | multistep | cosine | linear_warmup | reduce_on_plateau | lr_range
  int64_t step_size = 1000;   // step
  std::vector<int64_t> milestones;  // multistep: increasing optimizer steps
  double gamma = 0.1;               // step, multistep
  int64_t warmup_steps = 0;         // cosine (default 0), linear_warmup (default 100)
  int64_t max_steps = -1;           // cosine; -1: the run's length
  double warmup_start_factor = 0.0, min_lr_factor = 0.0;  // cosine (both), linear_warmup (the first)
  std::string monitor = "val/loss";  // reduce_on_plateau
  bool mode_max = false;
  double factor = 0.1, threshold = 1e-4, min_lr = 0.0;
  int64_t patience = 10, cooldown = 0;
  double end_factor = 1e8;  // lr_range: the lr's factor at its last step
  int64_t range_steps = 100;  // lr_range: its steps
  Section section;
};

struct Experiment {
  std::string name = "experiment";
  int64_t seed = 0;
  TrainerConfig trainer;
  LoggerConfig logger;
  Section task, model, data;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  std::vector<Section> callbacks;
  std::optional<InitFrom> init_from;  // model.init_from
  // `plugins:` (and --plugin): component libraries to load before anything is built, as absolute
  // paths (a relative one is taken from the config file's directory; the resolved config stores these).
  std::vector<PluginSpec> plugins;
};

}  // namespace strobe::config
