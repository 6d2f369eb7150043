// Starts the ranks of a test job as real processes on 127.0.0.1 (fork of the test process, before
// it has started any thread), each with torchrun's variables set, and collects exit status, stderr
// and wall time. Every rank's body runs under the CPU test double backend (store_backend.h).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace strobe::testing {

struct RankResult {
  int exit_code = -1;   // exit status, or 128 + signal
  std::string stderr_text;
  double seconds = 0;   // from the start of the job to this rank's end
};

// A free TCP port on 127.0.0.1 (bound and released; good enough for tests).
int free_port();

// Runs body(rank) in `world` processes; a body's return value is its exit status (an escaping
// exception prints one line and exits 1). Kills every rank still running after `deadline`.
std::vector<RankResult> run_ranks(int world, const std::function<int(int rank)>& body, const std::string& work_dir,
                                  std::chrono::seconds deadline = std::chrono::seconds(120));

}  // namespace strobe::testing
