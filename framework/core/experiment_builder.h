// Builds a whole run — data, model, task, callbacks, trainer — from an experiment document, and
// picks the run directory. Used by the CLI and by tests that want exactly the CLI's behaviour.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framework/config/experiment.h"
#include "framework/core/trainer.h"

namespace strobe {

struct Run {
  config::Experiment experiment;
  std::shared_ptr<Module> module;
  std::shared_ptr<DataModule> datamodule;
  std::vector<std::shared_ptr<Callback>> callbacks;
  std::unique_ptr<Trainer> trainer;
  std::string run_dir;
  std::string resolved_yaml;  // the config with every default filled in
};

struct RunOptions {
  Stage stage = Stage::Fit;
  std::optional<std::string> run_dir;   // --run-dir
  std::optional<std::string> ckpt;      // --ckpt (fit resumes in the checkpoint's run directory)
  bool create_run_dir = true;           // false: no files at all (tests, validate/test)
};

// Throws config::ConfigError for any bad key; writes <run_dir>/config.yaml when it creates the run dir.
std::unique_ptr<Run> build_run(config::Document& doc, const RunOptions& options);

// <default_root_dir>/<name>/version_<n> with the next free n.
std::string next_version_dir(const std::string& root, const std::string& name);

}  // namespace strobe
