// Reading an experiment document into the typed Experiment (strobe/config/experiment.h): the
// engine's side, not installed (a component reads its own section; docs/EXTENDING.md).
#pragma once

#include <optional>
#include <string>

#include "strobe/config/config.h"
#include "strobe/config/experiment.h"

namespace strobe::config {

// Read and check one section each (ConfigError naming the key); the defaults are written into the
// section, so the resolved config shows them.
OptimizerConfig parse_optimizer(Section section);
SchedulerConfig parse_scheduler(Section section);

// "DD:HH:MM:SS" (or fewer fields, "HH:MM:SS", "MM:SS", "SS") into seconds; nullopt on bad syntax.
std::optional<double> parse_duration(const std::string& text);

// Validates the top level and the trainer section of `doc`; throws ConfigError.
Experiment parse_experiment(Document& doc);

}  // namespace strobe::config
