// Resume compatibility: the resolved config saved in a checkpoint against the config of the run
// that wants to continue from it. Changes that make the saved state meaningless for the new run
// (another optimizer or scheduler, another optimizer hyper-parameter, another precision, another
// model or task) are refused before any state is loaded; the rest (max_steps, logging, callbacks,
// ...) are allowed and listed. Changes
// of other model keys are allowed only while every parameter keeps its shape: the caller, which has
// the tensors, decides (model_changes below). No torch here.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace YAML {
class Node;
}

namespace strobe::config {

// A config's leaves: (dotted path, value text), in document order.
using ConfigLeaves = std::vector<std::pair<std::string, std::string>>;

// A config's leaves as (path, text), in document order: the one flattening of a config (the resume
// check compares it, the TensorBoard logger records it as hparams). Paths are dotted, list elements
// [i] ("callbacks[0].monitor"); a list of scalars is one leaf, "[32, 16]"; null is "null". Throws
// YAML::Exception when `yaml` is not YAML.
ConfigLeaves flatten_config(const std::string& yaml);
ConfigLeaves flatten_config(const YAML::Node& root);

struct ConfigChange {
  std::string key;     // dotted path, list elements as [i]: "optimizer.name", "callbacks[0].monitor"
  std::string before;  // the checkpoint's value ("(absent)" when the key is new)
  std::string after;   // the current value ("(absent)" when the key was dropped)
  std::string why;     // incompatible changes: what cannot carry over
  std::string text() const;  // "optimizer.name: adamw -> sgd"
};

struct ResumeCheck {
  std::vector<ConfigChange> incompatible;
  std::vector<ConfigChange> model_changes;  // model.* other than model.name: fine unless a shape changed
  std::vector<ConfigChange> allowed;
};

// Two leaf values of a config (as compare_for_resume flattens them: a scalar's text, or a list of
// scalars as "[a, b]") are the same when their texts are, or when both are numbers of one value:
// 10000 and 10000.0, 1e-05 and 1.0000000000000001e-05 (element by element in a list).
bool same_config_value(const std::string& a, const std::string& b);

// Throws ConfigError when either text is not YAML. Numbers compare as numbers (same_config_value).
ResumeCheck compare_for_resume(const std::string& checkpoint_yaml, const std::string& current_yaml);
// The same on configs already flattened (a checkpoint's SavedConfig, strobe/config/saved_config.h).
ResumeCheck compare_for_resume(const ConfigLeaves& checkpoint, const ConfigLeaves& current);

// "a -> b, c -> d" (at most `max` entries, then "and N more").
std::string join_changes(const std::vector<ConfigChange>& changes, size_t max = 8);

}  // namespace strobe::config
