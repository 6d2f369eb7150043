// Starts the ranks of a test job as real processes on 127.0.0.1 (fork of the test process, which
// must not have initialized CUDA or started threads yet), each with torchrun's variables set
// (LOCAL_RANK = RANK), and collects exit status, stderr and wall time. Header-only: the CPU tests
// (tests/distributed) and the GPU tests (tests/gpu_distributed) share it.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace strobe::testing {

struct RankResult {
  int exit_code = -1;  // exit status, or 128 + signal
  std::string stderr_text;
  double seconds = 0;  // from the start of the job to this rank's end
};

// A free TCP port on 127.0.0.1 (bound and released; good enough for tests).
// run_ranks: runs body(rank) in `world` processes after child_setup(); a body's return value is its
// exit status (an escaping exception prints one line and exits 1). Kills every rank still running
// after `deadline`.


inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

inline std::vector<RankResult> run_ranks(int world, const std::function<int(int rank)>& body, const std::string& work_dir,
                                         std::chrono::seconds deadline, const std::function<void()>& child_setup) {
  std::filesystem::create_directories(work_dir);
  const int port = free_port();
  const auto start = std::chrono::steady_clock::now();
  std::vector<pid_t> pids(world);
  for (int r = 0; r < world; ++r) {
    std::fflush(nullptr);
    pid_t pid = ::fork();
    if (pid == 0) {
      std::string err = work_dir + "/rank" + std::to_string(r) + ".stderr";
      if (!std::freopen(err.c_str(), "w", stderr)) std::_Exit(99);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (child_setup) child_setup();
      int code = 1;
      try {
        code = body(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "uncaught: %s\n", e.what());
      }
      std::fflush(nullptr);
      std::_Exit(code);  // never return into the test framework
    }
    pids[r] = pid;
  }
  std::vector<RankResult> out(world);
  int left = world;
  while (left > 0) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < world; ++r) {
        if (pids[r] != pid) continue;
        out[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        out[r].seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        pids[r] = -1;
        --left;
      }
      continue;
    }
    if (std::chrono::steady_clock::now() - start > deadline) {
      for (int r = 0; r < world; ++r)
        if (pids[r] > 0) {
          ::kill(pids[r], SIGKILL);
          ::waitpid(pids[r], nullptr, 0);
          out[r].exit_code = 128 + SIGKILL;
          out[r].stderr_text = "(killed by the test: still running at the deadline)\n";
          pids[r] = -1;
          --left;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    std::ifstream in(work_dir + "/rank" + std::to_string(r) + ".stderr");
    std::stringstream ss;
    ss << in.rdbuf();
    out[r].stderr_text += ss.str();
  }
  return out;
}

// Every rank's exit code, time and standard error, for a failure message.
inline std::string describe(const std::vector<RankResult>& rs) {
  std::ostringstream os;
  for (size_t r = 0; r < rs.size(); ++r)
    os << "rank " << r << ": exit " << rs[r].exit_code << " after " << rs[r].seconds << " s, stderr:\n" << rs[r].stderr_text;
  return os.str();
}

inline int count_lines_with(const std::string& text, const std::string& needle) {
  std::istringstream in(text);
  int n = 0;
  for (std::string line; std::getline(in, line);)
    if (line.find(needle) != std::string::npos) ++n;
  return n;
}

}  // namespace strobe::testing
