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

// A command that does not train says so (not "before training started") and leaves no output.
TEST(CliSignals, ASignalStopsAPredictionSayingWhatStopped) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("sig-predict");
  auto fit = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run --set trainer.max_steps=1");
  ASSERT_EQ(fit.code, 0) << fit.err;
  Child c = start({"predict", "-c", cfg, "--ckpt", dir + "/run/checkpoints/last.ckpt", "-o", dir + "/p.csv", "--split", "val",
                   "--set", "data.num_classes=20000", "--set", "data.image_size=64"},
                  dir);
  ASSERT_TRUE(wait_until([&] { return catches(c.pid, SIGTERM); })) << "strobe never installed its handler";
  kill(c.pid, SIGTERM);
  EXPECT_EQ(wait_for(c), 143);
  EXPECT_EQ(c.err(), "\nstrobe predict: SIGTERM received; stopped (an output it was writing is left as it was)\n");
  EXPECT_FALSE(std::filesystem::exists(dir + "/p.csv"));
}

namespace {
// Steps of about a second on two cores (a 4096-wide layer at batch 512), so that signals land
// inside a step; a checkpoint every 2 steps.
std::string slow_yaml() {
  return tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    every_n_steps: 2\n    save_top_k: 0\n";
}
std::vector<std::string> slow_args(const std::string& cfg, const std::string& run) {
  return {"fit", "-c", cfg, "--run-dir", run, "--set", "model.hidden=[4096, 4096]", "--set", "data.batch_size=512",
          "--set", "data.num_samples=20480", "--set", "trainer.num_sanity_val_steps=0"};
}
int64_t logged_steps(const std::string& run) {
  auto rows = read_csv(run + "/metrics.csv", "train/loss");
  return rows.empty() ? 0 : rows.rbegin()->first;
}
}  // namespace

TEST(CliSignals, FirstSignalSaysAtOnceWhichStepFinishesThenSaves) {
  const std::string cfg = write_config(slow_yaml());
  const std::string dir = temp_dir("sig-first");
  Child c = start(slow_args(cfg, dir + "/run"), dir);
  ASSERT_TRUE(wait_until([&] { return logged_steps(dir + "/run") >= 3; })) << c.err();
  kill(c.pid, SIGTERM);
  // The answer comes at once, before the step in progress has finished.
  ASSERT_TRUE(wait_until([&] { return c.err().find("finishing step") != std::string::npos; }, 5)) << c.err();
  std::smatch m;
  const std::string first = c.err();
  ASSERT_TRUE(std::regex_search(first, m, std::regex(R"(strobe fit: SIGTERM received: finishing step (\d+), then saving (\S+)/checkpoints/last.ckpt \(a second signal stops at once without saving\)\n)")))
      << first;
  const int64_t step = std::stoll(m[1]);
  EXPECT_EQ(m[2].str(), dir + "/run");
  EXPECT_EQ(wait_for(c), 143) << c.err();
  auto ckpt = strobe::checkpoint::load_checkpoint_file(dir + "/run/checkpoints/last.ckpt");
  EXPECT_NE(ckpt.blob("meta").find("\"global_step\":" + std::to_string(step) + ","), std::string::npos)
      << "announced step " << step << ", saved " << ckpt.blob("meta");
  EXPECT_NE(c.err().find("saved " + dir + "/run/checkpoints/last.ckpt at step " + std::to_string(step)), std::string::npos) << c.err();
}

TEST(CliSignals, SecondSignalSaysNothingWasSaved) {
  const std::string cfg = write_config(slow_yaml());
  const std::string dir = temp_dir("sig-second");
  Child c = start(slow_args(cfg, dir + "/run"), dir);
  ASSERT_TRUE(wait_until([&] { return std::filesystem::exists(dir + "/run/checkpoints/last.ckpt"); })) << c.err();
  kill(c.pid, SIGINT);
  ASSERT_TRUE(wait_until([&] { return c.err().find("finishing step") != std::string::npos; }, 5)) << c.err();
  kill(c.pid, SIGINT);
  EXPECT_EQ(wait_for(c), 130);
  const std::string err = c.err();
  const std::string second =
      "\nstrobe fit: second signal (SIGINT): stopping now; nothing was saved (the last checkpoint written before stays as it was)\n";
  ASSERT_GE(err.size(), second.size()) << err;
  EXPECT_EQ(err.substr(err.size() - second.size()), second) << err;
  EXPECT_EQ(err.find("saved " + dir), std::string::npos) << err;
  // last.ckpt is one from before the signals (a checkpoint every 2 steps), intact.
  EXPECT_NO_THROW(strobe::checkpoint::load_checkpoint_file(dir + "/run/checkpoints/last.ckpt"));
}

TEST(CliSignals, InheritedIgnoredSigintStaysIgnoredAndSigtermStillStops) {
  const std::string cfg = write_config(slow_yaml());
  const std::string dir = temp_dir("sig-ignored");
  Child c = start(slow_args(cfg, dir + "/run"), dir, /*ignore_sigint=*/true);
  // Early (during start-up) and during training: both ignored, consistently.
  ASSERT_TRUE(wait_until([&] { return catches(c.pid, SIGTERM); }));
  kill(c.pid, SIGINT);
  ASSERT_TRUE(wait_until([&] { return logged_steps(dir + "/run") >= 2; })) << c.err();
  kill(c.pid, SIGINT);
  const int64_t at = logged_steps(dir + "/run");
  ASSERT_TRUE(wait_until([&] { return logged_steps(dir + "/run") >= at + 2; })) << "SIGINT stopped the run\n" << c.err();
  EXPECT_EQ(c.err().find("received"), std::string::npos) << c.err();
  EXPECT_NE(c.err().find("strobe fit: SIGINT is ignored (inherited from the parent process); stop the run with SIGTERM\n"),
            std::string::npos)
      << c.err();
  kill(c.pid, SIGTERM);
  EXPECT_EQ(wait_for(c), 143) << c.err();
  EXPECT_TRUE(std::filesystem::exists(dir + "/run/checkpoints/last.ckpt"));
}
