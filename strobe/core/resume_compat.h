// Resume compatibility (docs/ARCHITECTURE.md, "Resume compatibility"): before
// any state of a checkpoint is restored for training, its resolved config is compared with the
// current one. Another optimizer, scheduler, precision, model or task, or model keys that change a
// parameter's shape, are refused with a CheckpointError naming each change and why (exit 2 in the
// CLI, instead of an assertion deep in torch's optimizer loading); other changes (max_steps,
// logging, callbacks, ...) are allowed and returned for the caller to list.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <torch/nn/module.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/resume_check.h"
#include "strobe/config/saved_config.h"

namespace strobe {

// The checkpoint's saved config against the current one, compared once per load and shared by the
// checks below.
struct ConfigComparison {
  std::shared_ptr<const config::SavedConfig> saved;  // null: the checkpoint holds none, or it does not parse
  std::optional<config::ResumeCheck> check;          // both configs known and parsed
  std::string error;                                 // the saved or the current config does not parse
};
// `parsed`: the checkpoint's config when the command already parsed it (build_run reads its
// plugins), used when its text is the checkpoint's; otherwise it is parsed here. `current_yaml`
// empty (a program that set no resolved config): no comparison.
ConfigComparison compare_configs(const checkpoint::CheckpointData& data, const std::string& current_yaml,
                                 const std::shared_ptr<const config::SavedConfig>& parsed = nullptr);

// Every load of model weights is strict: the checkpoint's "model/" tensors and the model's parameters
// and buffers have the same names and shapes. Returns "" when they do; otherwise one line naming the
// model config keys that differ between the checkpoint's saved config and the current one when there
// are any ("model.depth: checkpoint 34, config 18"), else the first missing, unexpected and
// mis-shaped tensor names, each with how many more there are.
std::string weights_mismatch(const checkpoint::CheckpointData& data, const ConfigComparison& configs, torch::nn::Module& net);

// The model keys of the checkpoint's saved config that keep every shape but change the function the
// weights compute (rope_theta, rope_scaling, norm_eps, gelu) and differ from the current config, as
// "model.rope_theta: checkpoint 500000, config 10000"; "" when none (or either config is unknown).
std::string function_changes(const ConfigComparison& configs);

// For a refusal of `ckpt_path`'s weights: when it is a run's checkpoint (<run>/checkpoints/X.ckpt)
// and <run>/config.yaml's model section is the one the checkpoint recorded, "; -c <run>/config.yaml
// builds the model this checkpoint was trained as"; else "".
std::string run_config_hint(const std::string& ckpt_path, const ConfigComparison& configs);

// Returns the allowed changes, sorted by key (none when nothing changed). No current config or a
// checkpoint without a config: only the shapes are checked. A config that does not parse is refused.
std::vector<config::ConfigChange> check_resume_compatible(const std::string& ckpt_path, const checkpoint::CheckpointData& data,
                                                          const ConfigComparison& configs, torch::nn::Module& net);

}  // namespace strobe
