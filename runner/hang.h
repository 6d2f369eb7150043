// strobe hang RUN_DIR (docs/DISTRIBUTED.md, "When a run hangs"): reads the records of collectives
// every rank of a multi-process run wrote into its run directory when it hung or its collectives
// diverged (collectives_rank<r>.json) and says where the ranks parted: the last collective they
// agree on, the first they do not, and which rank diverged first.
#pragma once

#include <stdexcept>
#include <string>

namespace strobe {

// A folder without records, or a file that is not one: exit 2 with one line.
struct HangError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The report, lines ending in '\n'.
std::string explain_hang(const std::string& run_dir);

}  // namespace strobe
