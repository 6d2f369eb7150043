// Limits and write failures through the real executable: a value too long for the config is one line
// and exit 2, never a crash (std::regex once recursed per character until the stack overflowed); a
// write the disk, a quota or the file-size limit refuses is one line naming the file and exit 1, the
// previous file kept and no temporary left; stale temporaries of dead writers are removed by the
// next writer of the same file; a FIFO or a device where a file is read is refused, never waited on
// (docs/CONFIG.md, "Limits" and "Exit codes").
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/safetensors.h"

#include "tests/cli/cli_test_util.h"
#include "tests/source_path.h"

using namespace strobe::testing;
namespace fs = std::filesystem;

namespace {

// The names in `dir` that start with '.' (temporaries).
std::vector<std::string> hidden_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string()[0] == '.') out.push_back(e.path().filename().string());
  return out;
}

}  // namespace

TEST(CliLimits, LongValuesKeysAndNamesAreOneLineAndExitTwo) {
  const std::string cfg = write_config(tiny_yaml());
  std::string deep = "a";
  for (int i = 0; i < 30000; ++i) deep += ".a";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--set trainer.max_steps=" + std::string(100000, '9'), "a value of 100000 bytes; a value may hold at most 65536 bytes"},
      {"--set trainer.max_steps=" + std::string(60000, '9'), "trainer.max_steps: expected an integer >= -1, got 999"},
      {"--set optimizer.lr=0." + std::string(60000, '1') + "x", "optimizer.lr: expected a number, got '0.111"},
      {"--set " + deep + "=1", "a key of more than 64 dotted parts"},
      {"--set name=" + std::string(60000, 'n'), "name: a run name of 60000 characters"},
      {"--set model.name=" + std::string(60000, 'm'), "model.name: unknown model 'mmm"},
  };
  for (const auto& [args, want] : cases) {
    auto r = strobe_cmd("fit -c " + cfg + " " + args + " --run-dir " + temp_dir("long"));
    EXPECT_EQ(r.code, 2) << want;
    EXPECT_EQ(count_lines(r.err), 1) << r.err.substr(0, 300);
    EXPECT_LT(r.err.size(), 600u) << r.err.substr(0, 300);
    EXPECT_NE(r.err.find(want), std::string::npos) << r.err.substr(0, 300) << "\nwanted: " << want;
  }
  // The same values in a file.
  std::string yaml = tiny_yaml();
  yaml.replace(yaml.find("name: tiny"), 10, "name: \"" + std::string(60000, 'x') + "\"");
  auto r = strobe_cmd("fit -c " + write_config(yaml));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("exp.yaml:1:1: name: a run name of 60000 characters"), std::string::npos) << r.err.substr(0, 300);
  yaml = tiny_yaml();
  yaml.replace(yaml.find("lr: 0.01"), 8, "lr: 0." + std::string(70000, '1'));
  r = strobe_cmd("fit -c " + write_config(yaml));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("exp.yaml:26:7: a value of 70002 bytes"), std::string::npos) << r.err.substr(0, 300);
}

TEST(CliWriteFailures, AFileSizeLimitFailsTheWriteNamingTheFileKeepsThePreviousAndExitsOne) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("write-limit");
  const std::string big = " --set model.hidden=[512] --set trainer.max_epochs=-1";
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + big + " --set trainer.max_steps=2");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string last = dir + "/checkpoints/last.ckpt";
  const std::string before = slurp(last);
  ASSERT_GT(before.size(), 200u * 1024);

  // A resume whose next checkpoint meets `ulimit -f` (100 KiB): SIGXFSZ would kill it silently.
  r = shell_cmd("ulimit -f 100; ", "fit -c " + cfg + " --ckpt " + last + big + " --set trainer.max_steps=4");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err.rfind("strobe: write error: " + dir + "/checkpoints/", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(".ckpt: write failed (File too large)\n"), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_EQ(slurp(last), before) << "the previous last.ckpt was replaced";
  EXPECT_EQ(hidden_files(dir + "/checkpoints"), std::vector<std::string>{}) << "a temporary was left behind";

  // export: the same, and the next writer of the file removes what dead writers left beside it.
  const std::string out = dir + "/w.safetensors";
  r = strobe_cmd("export " + last + " -o " + out);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string exported = slurp(out);
  ASSERT_GT(exported.size(), 100u * 1024);
  const std::string dead = dir + "/.w.safetensors.tmp.2147483647";  // above any pid_max: gone
  const std::string live = dir + "/.w.safetensors.tmp." + std::to_string(::getpid());
  const std::string other = dir + "/.other.safetensors.tmp.2147483647";  // another file's: not this writer's
  for (const auto& p : {dead, live, other}) std::ofstream(p) << "partial";
  r = shell_cmd("ulimit -f 100; ", "export " + last + " -o " + out + " --overwrite");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err, "strobe: write error: " + out + ": write failed (File too large)\n");
  EXPECT_EQ(slurp(out), exported) << "a failed export replaced its output";
  EXPECT_FALSE(fs::exists(dead)) << "a dead writer's temporary stayed";
  EXPECT_TRUE(fs::exists(live)) << "a live writer's temporary was removed";
  EXPECT_TRUE(fs::exists(other));
  EXPECT_EQ(hidden_files(dir).size(), 2u) << "the failed export left its temporary";
}

// Every place Strobe reads a file a user names, given a FIFO (no writer: an open or a read would block
// forever) or a device (read until memory runs out): one line and exit 2, never a hang. Each command
// runs under `timeout 20` so a hang fails the test instead of stalling the suite.
TEST(CliNonRegularFiles, AFifoOrADeviceWhereAFileIsReadIsOneLineAndExitTwo) {
  const std::string dir = temp_dir("fifo");
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const std::string zero = dir + "/zero.yaml";
  fs::create_symlink("/dev/zero", zero);
  const std::string cfg = write_config(tiny_yaml());
  // A Hugging Face directory whose shard index is a FIFO, one whose index names a FIFO shard.
  fs::create_directories(dir + "/hf_index");
  ASSERT_EQ(::mkfifo((dir + "/hf_index/model.safetensors.index.json").c_str(), 0644), 0);
  fs::create_directories(dir + "/hf_shard");
  std::ofstream(dir + "/hf_shard/model.safetensors.index.json") << R"({"weight_map": {"fc1.weight": "shard-1.safetensors"}})";
  ASSERT_EQ(::mkfifo((dir + "/hf_shard/shard-1.safetensors").c_str(), 0644), 0);
  fs::create_directories(dir + "/capture");
  ASSERT_EQ(::mkfifo((dir + "/capture/capture.ckpt").c_str(), 0644), 0);
  std::string text_yaml = tiny_yaml();  // data: a text file that is a FIFO (data is read before the model)
  text_yaml.replace(text_yaml.find("data:\n"), text_yaml.find("optimizer:") - text_yaml.find("data:\n"),
                    "data:\n  name: text_file\n  path: " + fifo + "\n");
  const std::string text_data = write_config(text_yaml);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"fit -c " + fifo, fifo + ": the config is empty"},
      {"fit -c " + zero, zero + ": is not a regular file or a pipe (a device?)"},
      {"fit -c " + cfg + " --set model.init_from=" + fifo, fifo + ": is a FIFO, not a regular file"},
      {"fit -c " + cfg + " --set model.init_from=" + dir + "/hf_index", "model.safetensors.index.json: is a FIFO, not a regular file"},
      {"fit -c " + cfg + " --set model.init_from=" + dir + "/hf_shard", "shard-1.safetensors: is a FIFO, not a regular file"},
      {"fit -c " + cfg + " --ckpt " + fifo + " --run-dir " + dir + "/run", fifo + ": is a FIFO, not a regular file"},
      {"validate -c " + cfg + " --ckpt " + fifo, fifo + ": is a FIFO, not a regular file"},
      {"export " + fifo + " -o " + dir + "/w.safetensors", fifo + ": is a FIFO, not a regular file"},
      {"replay " + dir + "/capture", "capture.ckpt: is a FIFO, not a regular file"},
      {"list --plugin " + fifo, fifo + ": is a FIFO, not a shared library file"},
      {"fit -c " + text_data, fifo + ": is a FIFO, not a regular file"},
  };
  for (const auto& [args, want] : cases) {
    auto r = shell_cmd("timeout 20 ", args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << args << "\n" << r.err << "wanted: " << want;
  }
  // A pipe that carries a config is read (-c /dev/stdin, -c <(cmd)); one that carries too much is not.
  auto piped = shell_cmd("cat " + cfg + " | timeout 60 ",
                         "fit -c /dev/stdin --run-dir " + dir + "/piped --set trainer.max_steps=1 --set trainer.max_epochs=-1");
  EXPECT_EQ(piped.code, 0) << piped.err;
  auto flood = shell_cmd("yes 'a: 1' | head -c 5000000 | timeout 20 ", "fit -c /dev/stdin");
  EXPECT_EQ(flood.code, 2) << flood.err;
  EXPECT_EQ(flood.err, "strobe: config error: /dev/stdin: more than 4194304 bytes; a config file may hold at most 4194304 bytes\n");
}

// A weights file of 100,000 tensors the model does not have: refused in seconds, in a line that names
// the first few and the count (the check was quadratic and the line listed all 100,000 names).
TEST(CliNonRegularFiles, AWeightsFileOf100000StrayTensorsIsRefusedQuicklyInAShortLine) {
  const std::string dir = temp_dir("many-tensors");
  strobe::safetensors::NamedTensors tensors;
  for (int i = 0; i < 100000; ++i) tensors.emplace_back(fmt::format("stray.{}", i), torch::zeros({1}));
  strobe::safetensors::write_file(dir + "/w.safetensors", tensors, {});
  const auto t0 = std::chrono::steady_clock::now();
  auto r = strobe_cmd("fit -c " + write_config(tiny_yaml()) + " --set model.init_from=" + dir + "/w.safetensors");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 2) << r.err.substr(0, 400);
  EXPECT_EQ(count_lines(r.err), 1);
  EXPECT_LT(r.err.size(), 1500u) << r.err.substr(0, 400);
  EXPECT_NE(r.err.find("100000 not in the model: stray.0, stray.1, stray.10, "), std::string::npos) << r.err.substr(0, 400);
  EXPECT_NE(r.err.find(" and 99990 more"), std::string::npos) << r.err.substr(0, 400);
  EXPECT_LT(seconds, 20.0);
}

// Input that YAML or the command line would silently drop (the default would apply instead): one line
// and exit 2, before anything is written.
TEST(CliSilentInput, WhatYamlOrTheCommandLineWouldIgnoreIsOneLineAndExitTwo) {
  const std::string dir = temp_dir("silent");
  const std::string cfg = write_config(tiny_yaml("  default_root_dir: " + dir + "/runs\n"));
  const std::string second_doc = tiny_yaml() + "---\ntrainer:\n  max_epochs: 9\n";
  const std::string after_end = tiny_yaml() + "...\noptimizer:\n  lr: 0.5\n";
  const std::string second_line = "exp.yaml:" + std::to_string(count_lines(tiny_yaml()) + 2) + ":1: ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"fit -c " + cfg + " --set name=---", "--set name=---: YAML reads the value as no value"},
      {"fit -c " + cfg + " --set name=...", "--set name=...: YAML reads the value as no value"},
      {"fit -c " + cfg + " --set 'optimizer.lr=# x'", "--set optimizer.lr=# x: YAML reads the value as no value"},
      {"fit -c " + cfg + " --set 'name=a\n---\nb'", "YAML reads the value as two documents"},
      {"fit -c " + write_config(second_doc), second_line + "a second YAML document (after a '---' or '...' line)"},
      {"fit -c " + write_config(after_end), second_line + "a second YAML document"},
      {"fit -c " + cfg + " --run-dir ''", "strobe: --run-dir: an empty path; give a path or leave the option out"},
      {"fit -c " + cfg + " --ckpt ''", "strobe: --ckpt: an empty path"},
      {"export '' -o " + dir + "/w.safetensors", "an empty path"},
      {"replay " + dir + " --report ''", "strobe: --report: an empty path"},
  };
  for (const auto& [args, want] : cases) {
    auto r = strobe_cmd(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << args << "\n" << r.err << "wanted: " << want;
  }
  EXPECT_FALSE(fs::exists(dir + "/runs")) << "a refused command wrote a run";
  // Only a null spelt out means the default.
  auto null_name = strobe_cmd("fit -c " + cfg + " --set name=null --run-dir " + dir + "/null --set trainer.max_steps=1");
  EXPECT_EQ(null_name.code, 0) << null_name.err;
  EXPECT_NE(slurp(dir + "/null/config.yaml").find("name: experiment\n"), std::string::npos);
}

// max_steps without max_epochs trains until max_steps (Lightning's rule; config.yaml records -1), and
// the summary says which limit ended the run.
TEST(CliSilentInput, MaxStepsAloneIsNotCutShortByADefaultEpochAndTheSummarySaysWhatEnded) {
  std::string yaml = tiny_yaml();
  yaml.erase(yaml.find("  max_epochs: 2\n"), 16);
  const std::string cfg = write_config(yaml);
  const std::string dir = temp_dir("max-steps");
  // 96 samples in batches of 8: 12 steps an epoch; 30 steps take three epochs.
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/steps --set trainer.max_steps=30");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("strobe fit: finished at step 30, epoch 2 in "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" s (trainer.max_steps: 30 reached)\n"), std::string::npos) << r.out;
  EXPECT_NE(slurp(dir + "/steps/config.yaml").find("max_epochs: -1\n"), std::string::npos);
  // Both set: the first reached ends the run, and the summary names it.
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/epochs --set trainer.max_steps=30 --set trainer.max_epochs=2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("strobe fit: finished at step 24, epoch 1 in "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" s (trainer.max_epochs: 2 reached)\n"), std::string::npos) << r.out;
  // Neither set: one epoch.
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/default");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("strobe fit: finished at step 12, epoch 0 in "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" s (trainer.max_epochs: 1 reached)\n"), std::string::npos) << r.out;
}

// A checkpoint that lacks what a resume restores is refused naming what is missing (it resumed with a
// fresh optimizer, or without the compatibility check); a model key that keeps the shapes but changes
// the function (rope_theta, rope_scaling) is refused on resume, and validate says it differs.
TEST(CliResumeInput, IncompleteCheckpointsAndFunctionChangingKeysAreRefusedNamingWhat) {
  const std::string dir = temp_dir("resume-input");
  const std::string cfg = write_config(tiny_yaml());
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run --set trainer.max_steps=2");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string last = dir + "/run/checkpoints/last.ckpt";
  for (const std::string blob : {"config", "optimizer", "loop"}) {
    auto d = strobe::checkpoint::load_checkpoint_file(last);
    d.blobs.erase(blob);
    const std::string cut = dir + "/no-" + blob + ".ckpt";
    strobe::checkpoint::save_checkpoint_file(cut, d);
    r = strobe_cmd("fit -c " + cfg + " --ckpt " + cut + " --run-dir " + dir + "/resumed-" + blob +
                   " --set trainer.max_steps=4 --set optimizer.lr=0.5");
    EXPECT_EQ(r.code, 2) << blob << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(cut + ": cannot resume from it: it lacks "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("(blob '" + blob + "'); a file of weights alone is for starting a new run"), std::string::npos)
        << r.err;
  }

  const std::string llama = strobe::testing::source_path("configs/cpu/llama_1b.yaml");
  r = strobe_cmd("fit -c " + llama + " --run-dir " + dir + "/llama --set trainer.max_steps=2 --set trainer.enable_progress_bar=false");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = dir + "/llama/checkpoints/last.ckpt";
  for (const std::string& set : {"model.rope_theta=10000", "model.rope_scaling.factor=8"}) {
    r = strobe_cmd("fit -c " + llama + " --ckpt " + ckpt + " --set trainer.max_steps=3 --set " + set);
    EXPECT_EQ(r.code, 2) << set << "\n" << r.err;
    const std::string key = set.substr(0, set.find('='));
    EXPECT_NE(r.err.find(key + ": "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("(it changes the function the weights compute"), std::string::npos) << r.err;
  }
  r = strobe_cmd("validate -c " + llama + " --ckpt " + ckpt + " --set model.rope_theta=10000");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("strobe: warning: " + ckpt + ": evaluated with model keys that differ from the checkpoint's config: "
                       "model.rope_theta: checkpoint 500000, config 10000 (they change the function the weights compute)\n"),
            std::string::npos)
      << r.err;
  r = strobe_cmd("validate -c " + llama + " --ckpt " + ckpt);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
}
