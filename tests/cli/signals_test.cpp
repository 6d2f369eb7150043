// Stop signals through the real executable: before the loop, during a step (the first signal is
// answered at once, the step finishes, last.ckpt is saved), a second signal, an inherited-ignored SIGINT.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <thread>

#include "tests/cli/cli_test_util.h"

using namespace strobe::testing;

namespace {

struct Child {
  pid_t pid = -1;
  std::string dir;
  std::string err() const { return slurp(dir + "/stderr"); }
  std::string out() const { return slurp(dir + "/stdout"); }
};

// Starts `strobe <args>` with stdout/stderr in `dir`; `ignore_sigint` as a non-interactive shell
// does for background jobs.
Child start(const std::vector<std::string>& args, const std::string& dir, bool ignore_sigint = false) {
  Child c;
  c.dir = dir;
  c.pid = fork();
  if (c.pid == 0) {
    freopen((dir + "/stdout").c_str(), "w", stdout);
    freopen((dir + "/stderr").c_str(), "w", stderr);
    if (ignore_sigint) signal(SIGINT, SIG_IGN);
    std::vector<char*> argv{const_cast<char*>(bin().c_str())};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(bin().c_str(), argv.data());
    _exit(127);
  }
  return c;
}

// The exit status, or -signal when killed by one.
int wait_for(const Child& c) {
  int status = 0;
  waitpid(c.pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

// The process catches `sig` (its handler is installed): /proc/<pid>/status SigCgt.
bool catches(pid_t pid, int sig) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("SigCgt:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> (sig - 1)) & 1;
  return false;
}

template <class F>
bool wait_until(F ready, int seconds = 120) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

}  // namespace

TEST(CliSignals, ASignalBeforeTheLoopExitsWithAMessage) {
  // Setting up takes a while here: 20000 class templates of 64 x 64 pixels.
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("sig-early");
  Child c = start({"fit", "-c", cfg, "--run-dir", dir + "/run", "--set", "data.num_classes=20000", "--set",
                   "model.num_classes=20000", "--set", "data.image_size=64", "--set", "model.in_features=4096"},
                  dir);
  ASSERT_TRUE(wait_until([&] { return catches(c.pid, SIGINT); })) << "strobe never installed its handler";
  kill(c.pid, SIGINT);
  EXPECT_EQ(wait_for(c), 130);
  EXPECT_EQ(c.err(), "\nstrobe: SIGINT received before training started; exiting (nothing to save)\n");
  EXPECT_FALSE(std::filesystem::exists(dir + "/run/checkpoints"));
}

