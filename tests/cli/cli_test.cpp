// The strobe executable: exit codes and one-line messages for bad input, SIGTERM/SIGINT handling
// with exact resume, and the quickstart's first steps.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "strobe/core/callback.h"
#include "strobe/core/datamodule.h"
#include "strobe/core/model.h"
#include "strobe/core/module.h"
#include "strobe/metrics/registry.h"
#include "tests/cli/cli_test_util.h"
#include "tests/source_path.h"

using namespace strobe;
using namespace strobe::testing;

TEST(Cli, VersionAndHelp) {
  auto r = strobe_cmd("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("strobe 0.2.0"), std::string::npos) << r.out;
  r = strobe_cmd("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("fit"), std::string::npos);
  // A mistyped command names the closest one, then the usage hint; nothing starts.
  r = strobe_cmd("fti -c nowhere.yaml");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "strobe: unknown command 'fti'; did you mean 'fit'? (commands: fit, validate, test, predict, replay, export, bench, list, "
            "hang, tune, mlflow-sync); "
            "run 'strobe --help' for usage\n");
  r = strobe_cmd("xyzzy");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err.rfind("strobe: unknown command 'xyzzy' (commands: fit,", 0), 0u) << r.err;
}

// strobe list: every registry's names, from the registries themselves (this test links the same
// libstrobe), per kind one per line; --help shows them; an unknown kind is one line and exit 2.
TEST(Cli, ListShowsEveryRegisteredComponentByKind) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> kinds = {
      {"models", model_registry().names()},       {"tasks", task_registry().names()},
      {"data", data_registry().names()},          {"callbacks", callback_registry().names()},
      {"metrics", metrics::metric_registry().names()}};
  auto all = strobe_cmd("list");
  ASSERT_EQ(all.code, 0) << all.err;
  auto help = strobe_cmd("--help");
  for (const auto& [kind, names] : kinds) {
    ASSERT_FALSE(names.empty()) << kind;
    auto one = strobe_cmd("list " + kind);
    EXPECT_EQ(one.code, 0) << kind << ": " << one.err;
    std::string want;
    for (const auto& n : names) want += n + "\n";
    EXPECT_EQ(one.out, want) << kind;
    std::string joined;
    for (const auto& n : names) joined += (joined.empty() ? "" : ", ") + n;
    EXPECT_NE(all.out.find(kind + ":"), std::string::npos) << all.out;
    EXPECT_NE(all.out.find(joined), std::string::npos) << kind << " in strobe list:\n" << all.out;
    EXPECT_NE(help.out.find(joined), std::string::npos) << kind << " in strobe --help";
  }
  auto bad = strobe_cmd("list modle");
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(bad.out, "");
  EXPECT_EQ(bad.err, "strobe list: unknown kind 'modle'; did you mean 'models'? (known: models, tasks, data, callbacks, metrics)\n");
}

TEST(Cli, UnknownKeyExitsTwoWithOneLine) {
  std::string cfg = write_config(tiny_yaml("  max_stepz: 3\n"));
  auto r = strobe_cmd("fit -c " + cfg);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe: config error: " + cfg + ":9:3: trainer.max_stepz: unknown key; did you mean 'max_steps'?\n");
}

TEST(Cli, BadInputsExitTwoWithOneLine) {
  std::string cfg = write_config(tiny_yaml());
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"fit -c /nonexistent.yaml", "/nonexistent.yaml: cannot open config file"},
      {"fit -c " + cfg + " --set trainer.max_steps", "--set trainer.max_steps: expected KEY=VALUE"},
      {"fit -c " + cfg + " --set trainer.max_steps=many", "trainer.max_steps: expected an integer >= -1, got 'many'"},
      {"fit -c " + cfg + " --set model.name=mpl", "model.name: unknown model 'mpl'; did you mean 'mlp'?"},
      {"fit -c " + cfg + " --set model.hiden=[3]", "model.hiden: unknown key; did you mean 'hidden'?"},
      {"fit -c " + cfg + " --set optimizer.lr=-1", "optimizer.lr: expected a number >= 0, got -1"},
      {"fit -c " + cfg + " --set 'data={name: fashion_mnist, root: /nonexistent}'", "data.root: '/nonexistent' is not a directory"},
      {"fit -c " + cfg + " --ckpt /nonexistent.ckpt", "/nonexistent.ckpt: cannot open checkpoint"},
      {"fit -c " + cfg + " --bogus", "The following argument was not expected: --bogus"},
      {"frobnicate", "strobe: unknown command 'frobnicate' (commands: fit,"},
      // What a message quotes is escaped to one line, here a kind with a newline in it.
      {"list \"$(printf 'x\\ny')\"", "strobe list: unknown kind 'x\\ny' (known:"},
      {"test -c " + cfg, "--ckpt is required"},
      {"fit -c " + cfg + " --set 'callbacks=[{name: nan_capture, spike: {window: 8, warmup: 16}}]'",
       "callbacks[0].spike.warmup: must not exceed spike.window (8)"},
      {"fit -c " + cfg + " --set 'callbacks=[{name: nan_capture, spike: {metric: los}}]'",
       "callbacks[0].spike.metric: expected one of"},
  };
  for (const auto& c : cases) {
    auto r = strobe_cmd(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
  }
  // A message over 1,500 characters (here a 3,000-character config path) is cut in the middle,
  // keeping its start and its end and saying how much was left out.
  std::string long_path = "/nonexistent";
  for (int i = 0; i < 30; ++i) long_path += "/" + std::string(99, 'p');
  long_path += "/x.yaml";
  auto r = strobe_cmd("fit -c " + long_path);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_LT(r.err.size(), 1400u) << r.err.size();
  EXPECT_EQ(r.err.rfind("strobe: config error: /nonexistent/ppp", 0), 0u) << r.err.substr(0, 100);
  EXPECT_NE(r.err.find(" characters left out ...] "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("/x.yaml: cannot open config file (No such file or directory)\n"), std::string::npos) << r.err;
}

TEST(Cli, CorruptedCheckpointIsRefused) {
  std::string cfg = write_config(tiny_yaml());
  std::string dir = temp_dir("cli-ckpt");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=2");
  ASSERT_EQ(r.code, 0) << r.err;
  std::string p = dir + "/checkpoints/last.ckpt";
  std::string s = slurp(p);
  s[s.size() / 3] ^= 1;
  std::ofstream(p, std::ios::binary | std::ios::trunc) << s;
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + p);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe: checkpoint error: " + p + ": corrupted checkpoint (checksum mismatch)\n");
}

namespace {
// Starts `strobe fit`, waits until it has logged step >= 3, sends `sig`, returns the exit status.
int fit_and_signal(const std::string& cfg, const std::string& dir, int sig) {
  pid_t pid = fork();
  if (pid == 0) {
    std::string out = dir + "/stdout";
    freopen(out.c_str(), "w", stdout);
    freopen((dir + "/stderr").c_str(), "w", stderr);
    execl(bin().c_str(), bin().c_str(), "fit", "-c", cfg.c_str(), "--run-dir", dir.c_str(), (char*)nullptr);
    _exit(127);
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    auto rows = read_csv(dir + "/metrics.csv", "train/loss");
    if (!rows.empty() && rows.rbegin()->first >= 3) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, sig);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}
}  // namespace

TEST(Cli, SigtermSavesACheckpointThatResumesExactly) {
  // Long enough to be interrupted: 600 steps of the tiny model.
  std::string yaml = tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n";
  auto doc = strobe::config::Document::load_string(yaml, "x");
  doc.apply_override("data.num_samples=4800");
  doc.apply_override("trainer.max_epochs=1");
  doc.apply_override("scheduler.max_steps=600");
  std::string cfg3 = write_config(doc.emit());
  std::string straight = temp_dir("straight-cli");
  auto r = strobe_cmd("fit -c " + cfg3 + " --run-dir " + straight);
  ASSERT_EQ(r.code, 0) << r.err;
  std::string dir = temp_dir("sigterm");
  int code = fit_and_signal(cfg3, dir, SIGTERM);
  ASSERT_EQ(code, 143) << slurp(dir + "/stderr");
  ASSERT_TRUE(std::filesystem::exists(dir + "/checkpoints/last.ckpt"));
  auto interrupted = strobe::checkpoint::load_checkpoint_file(dir + "/checkpoints/last.ckpt");
  EXPECT_NE(slurp(dir + "/stderr").find("SIGTERM received"), std::string::npos);

  r = strobe_cmd("fit -c " + cfg3 + " --ckpt " + dir + "/checkpoints/last.ckpt");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(bitwise_equal(model_tensors(dir + "/checkpoints/last.ckpt"), model_tensors(straight + "/checkpoints/last.ckpt")));
  EXPECT_EQ(read_csv(dir + "/metrics.csv", "train/loss"), read_csv(straight + "/metrics.csv", "train/loss"));
}

TEST(Cli, SigintExitsWith130) {
  auto doc = strobe::config::Document::load_string(tiny_yaml(), "x");
  doc.apply_override("data.num_samples=4800");
  doc.apply_override("scheduler.max_steps=1200");
  std::string cfg = write_config(doc.emit());
  std::string dir = temp_dir("sigint");
  EXPECT_EQ(fit_and_signal(cfg, dir, SIGINT), 130);
  EXPECT_TRUE(std::filesystem::exists(dir + "/checkpoints/last.ckpt"));
}


// strobe hang reads the records a run's ranks wrote (collectives_rank<r>.json; the runs that write
// them are tests/distributed's): rank 1's record stops at collective 4 while rank 0 went on to
// collective 5, so rank 1 diverged first, "never reached" it; with NCCL's flight recorder in the
// files, the NCCL collective they enqueued differently too. A folder without records, a file that
// is not one and a path that is no folder: one line, exit 2.
TEST(Cli, HangSaysWhichRankDivergedFirstAndWhere) {
  const std::string dir = temp_dir("hang");
  auto record = [&](int rank, int last, const std::string& status, nlohmann::json nccl = nullptr) {
    nlohmann::json j = {{"rank", rank}, {"world_size", 2}, {"status", status}, {"written_ns", 1}};
    if (!nccl.is_null()) j["nccl"] = nccl;
    auto& list = j["collectives"] = nlohmann::json::array();
    const char* kinds[] = {"host barrier", "parameter check", "setup broadcast", "gradient all-reduce", "stop agreement"};
    const char* ops[] = {"store", "all_gather", "broadcast", "all_reduce", "all_reduce"};
    for (int s = 1; s <= last; ++s)
      list.push_back({{"seq", s}, {"kind", kinds[s - 1]}, {"op", ops[s - 1]}, {"bytes", s == 5 ? 4 : 0},
                      {"issued_ns", 1764481801123000000 + s}, {"returned_ns", s == last ? 0 : 1}});
    std::ofstream(dir + "/collectives_rank" + std::to_string(rank) + ".json") << j.dump();
  };
  auto r = strobe_cmd("hang " + dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe hang: " + dir + " holds no collectives_rank<r>.json (a multi-process run writes them into its run "
                   "directory when it hangs or its ranks' collectives diverge)\n");
  record(0, 5, "this rank waits in collective 5, stop agreement (all_reduce, 4 B) for 7.0 s");
  record(1, 4, "this rank is not inside a collective call; its latest: collective 4, gradient all-reduce (all_reduce), issued 7.1 s ago");
  r = strobe_cmd("hang " + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "strobe hang: " + dir + ": the records of 2 of 2 rank(s)\n"
                   "the ranks agree up to collective 4, gradient all-reduce (all_reduce), issued 05:50:01.123 UTC\n"
                   "collective 5:\n"
                   "  rank 0 issued stop agreement (all_reduce, 4 B) at 05:50:01.123 UTC\n"
                   "  rank 1 never reached it; its last: collective 4, gradient all-reduce (all_reduce)\n"
                   "diverged first: rank 1 (the others issued there: stop agreement)\n"
                   "rank 0: this rank waits in collective 5, stop agreement (all_reduce, 4 B) for 7.0 s\n"
                   "rank 1: this rank is not inside a collective call; its latest: collective 4, gradient all-reduce "
                   "(all_reduce), issued 7.1 s ago\n");
  // Under NCCL the files carry c10d's flight recorder too: the first NCCL collective the ranks
  // enqueued differently, and where each rank's GPU waits.
  auto nccl = [](const char* sizes41, const char* state41) {
    return nlohmann::json{{"version", "2.10"},
                          {"entries", {{{"collective_seq_id", 40}, {"profiling_name", "nccl:all_reduce"}, {"state", "completed"},
                                        {"input_sizes", {{1048576}}}, {"is_p2p", false}},
                                       {{"collective_seq_id", 41}, {"profiling_name", "nccl:all_reduce"}, {"state", state41},
                                        {"input_sizes", nlohmann::json::parse(sizes41)}, {"is_p2p", false}}}}};
  };
  record(0, 5, "this rank waits in collective 5, stop agreement (all_reduce, 4 B) for 7.0 s", nccl("[[262144]]", "started"));
  record(1, 4, "this rank is not inside a collective call", nccl("[[4]]", "scheduled"));
  r = strobe_cmd("hang " + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string nccl_part = r.out.substr(r.out.find("NCCL's record"));
  EXPECT_EQ(nccl_part, "NCCL's record (c10d's flight recorder; its numbers count NCCL's launches, the ddp Reducer's bucket "
                       "all-reduces included):\n"
                       "  NCCL collective 41: rank 0 nccl:all_reduce [[262144]] (started); rank 1 nccl:all_reduce [[4]] (scheduled)\n"
                       "  rank 0: waits in NCCL collective 41, nccl:all_reduce [[262144]] (started)\n"
                       "  rank 1: waits in NCCL collective 41, nccl:all_reduce [[4]] (scheduled)\n");
  std::ofstream(dir + "/collectives_rank1.json") << "{\"rank\": 1}";
  r = strobe_cmd("hang " + dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err.rfind("strobe hang: " + dir + "/collectives_rank1.json: not a record of collectives (", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  r = strobe_cmd("hang " + dir + "/nowhere");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe hang: " + dir + "/nowhere is not a directory\n");
}
