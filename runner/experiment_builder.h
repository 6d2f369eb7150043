// Builds a whole run — data, model, task, callbacks, trainer — from an experiment document, and
// picks the run directory. Used by the CLI and by tests that want exactly the CLI's behaviour.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strobe/config/experiment.h"
#include "strobe/core/trainer.h"
#include "runner/run_dir.h"
#include "runner/step_memory.h"

namespace strobe {


namespace distributed {
class Strategy;
struct LaunchEnv;
}  // namespace distributed

struct Run {
  // Declared first, released last: the run directory stays locked until everything else is closed.
  std::shared_ptr<RunDirClaim> claim;  // fit, rank 0: the claimed and locked run directory
  // fit, rank 0: model_checkpoint directories outside the run directory, claimed and locked as it is
  std::vector<std::shared_ptr<CheckpointDirClaim>> checkpoint_dirs;
  config::Experiment experiment;
  std::shared_ptr<distributed::Strategy> strategy;  // one process, or this rank of a data-parallel job
  std::shared_ptr<Module> module;
  std::shared_ptr<DataModule> datamodule;
  std::vector<std::shared_ptr<Callback>> callbacks;
  std::unique_ptr<Trainer> trainer;
  // --ckpt, read once (build_run reads it first, for the plugins it recorded): hand it to the entry
  // point, e.g. run->trainer->fit(std::move(run->checkpoint)).
  std::optional<checkpoint::CheckpointData> checkpoint;
  std::string run_dir;
  std::string resolved_yaml;  // the config with every default filled in
  std::vector<std::string> plugin_changes;  // allowed changed plugins (--allow-changed-plugins), one line each
  std::optional<StepMemory> step_memory;    // fit: the training step's memory, measured before the run (runner/step_memory.h)
};

struct RunOptions {
  Stage stage = Stage::Fit;
  std::optional<std::string> run_dir;   // --run-dir
  std::optional<std::string> ckpt;      // --ckpt (fit resumes in the checkpoint's run directory)
  bool create_run_dir = true;           // false: no files at all (tests, validate/test)
  bool overwrite = false;               // --overwrite: a run directory holding another run is cleared first
  bool allow_changed_plugins = false;   // --allow-changed-plugins (runner/plugins.h)
  // Who this process is; unset: the launcher's environment (torchrun, Slurm, or one process).
  std::shared_ptr<const distributed::LaunchEnv> launch_env;
  // Callbacks a program adds after the configured ones (replay's gradient observer, a test's
  // recorder); their hooks run last.
  std::vector<std::shared_ptr<Callback>> extra_callbacks;
  // Called with the device the strategy chose, before the trainer moves anything to it
  // (`strobe bench step --memory-limit-gib` caps the GPU there).
  std::function<void(const torch::Device&)> on_device;
};

// Plugins load first: the experiment's, and with a checkpoint (`ckpt`) also those its resolved config
// recorded, each checked against its recorded hash (PluginError, exit 2; runner/plugins.h). The
// document then records every loaded plugin as {path, sha256}.
// Throws config::ConfigError for any bad key and for data that does not fit the model (classes,
// channels, image size, vocabulary, sequence length: both keys named) or a batch that cannot fit in
// the memory available; RunDirError when the run directory cannot be created, written or claimed
// (run_dir.h). The only thing written here is the claimed (empty, locked) run directory, and with
// --overwrite the removal of the old run's files: fit writes <run_dir>/config.yaml (atomically) once
// the run starts, i.e. after a checkpoint to resume from has loaded, and removes temp files a killed
// writer left in the run directory.
std::unique_ptr<Run> build_run(config::Document& doc, const RunOptions& options);

// The experiment a command runs: the -c files composed in order, each --set applied, each --plugin
// joined to its plugins: list (add_plugins_to, runner/plugins.h).
config::Document compose_experiment(const std::vector<std::string>& configs, const std::vector<std::string>& sets,
                                    const std::vector<std::string>& plugins);

// A run that only probes the experiment (strobe tune): no checkpoint, progress bar, model summary or
// callback, epochs unbounded (the caller's trainer.max_steps ends it). Build it with
// RunOptions::create_run_dir false, so that it writes nothing.
void make_probe_run(config::Document& doc);

// Checks the model's resolved keys (num_classes, in_channels, image_size/img_size, in_features,
// vocab_size, max_seq_len) against what the data provides; throws config::ConfigError.
void check_data_fits_model(config::Section& model, const std::string& data_name, const DataInfo& data);

}  // namespace strobe
