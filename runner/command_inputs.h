// What an experiment's command reads, for the output guard (strobe/checkpoint/output_guard.h): an
// output of `strobe predict` or `strobe bench --json` is never one of these, --overwrite or not.
#pragma once

#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "strobe/checkpoint/output_guard.h"

namespace strobe {

// The config file (`config_path`, "" for none) and every string of the experiment that names an
// existing file or directory (data files and roots, model.init_from, data.exclude, plugins), except
// under the keys that name outputs or no path (trainer, callbacks, any `name`).
std::vector<checkpoint::CommandInput> experiment_inputs(const YAML::Node& root, const std::string& config_path);

}  // namespace strobe
