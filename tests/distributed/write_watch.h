// Test helper: records which files this process creates or opens for writing under a directory, by
// interposing libc's open/open64/openat/fopen/fopen64/rename/mkdir in the test executable (the
// file calls go on as the same system calls; fopen to libc's own). Lets the data-parallel tests check that a rank other than 0 writes no run
// file at all, whatever code path (CSV, TensorBoard, checkpoints, config.yaml) would do it.
#pragma once

#include <string>
#include <vector>

namespace strobe::testing {

// Starts recording write-opens of paths that begin with `prefix` (absolute).
void watch_writes_under(const std::string& prefix);
// The paths recorded so far, in order.
std::vector<std::string> watched_writes();

}  // namespace strobe::testing
