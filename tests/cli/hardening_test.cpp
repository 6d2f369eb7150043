// Issue 10 through the real executable: every bad input exits 2 with one line, the run directory's
// files mean what they say (config.yaml, metrics.csv), and the console (progress bar, epochs, the
// end-of-fit summary) tells the truth.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <regex>
#include <set>

#include <fmt/format.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "tests/cli/cli_test_util.h"

using namespace strobe::testing;

namespace {

// A tiny experiment that also logs the learning rate and validates twice per epoch.
std::string logged_yaml() {
  return tiny_yaml("  val_check_interval: 0.5\n") + "callbacks:\n  - name: model_checkpoint\n    monitor: val/acc\n    mode: max\n  - name: lr_monitor\n";
}

}  // namespace

// --- bad input: exit 2, one line -------------------------------------------------------------

TEST(CliBadInput, SetErrorsNameTheSet) {
  const std::string cfg = write_config(tiny_yaml());
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"fit -c " + cfg + " --set trainer.max_steps=",
       "strobe: config error: --set trainer.max_steps=: empty value (to reset a key to its default write trainer.max_steps=null)\n"},
      {"fit -c " + cfg + " --set foo.bar=3", "strobe: config error: --set foo.bar=3: foo: unknown key"},
      {"fit -c " + cfg + " --set trainer.bogus.x=1", "strobe: config error: --set trainer.bogus.x=1: trainer.bogus: unknown key"},
      {"fit -c " + cfg + " --set trainer.cuda_graphs=maybe",
       "strobe: config error: --set trainer.cuda_graphs=maybe: trainer.cuda_graphs: expected one of false, true, auto, got 'maybe'\n"},
      // (tiny_yaml trains on the CPU: `true` is refused before any step, naming why)
      {"fit -c " + cfg + " --set trainer.cuda_graphs=true",
       "strobe: config error: trainer.cuda_graphs: needs a CUDA device (this run's device is cpu)\n"},
  };
  for (const auto& c : cases) {
    auto r = strobe_cmd(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_EQ(r.err.rfind(c.expect, 0), 0u) << c.args << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
}

// A 324-byte "billion laughs" (9 levels of 9 nested aliases) kept fit at 100% CPU for minutes.
TEST(CliBadInput, NestedAliasesAreRefusedAtOnce) {
  std::string yaml = tiny_yaml() + "a: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n";
  for (char c = 'b'; c <= 'i'; ++c) {
    yaml += std::string(1, c) + ": &" + c + " [";
    for (int k = 0; k < 9; ++k) yaml += std::string(k ? "," : "") + "*" + static_cast<char>(c - 1);
    yaml += "]\n";
  }
  const std::string cfg = write_config(yaml);
  const std::string dir = temp_dir("laughs");
  const auto t0 = std::chrono::steady_clock::now();
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err, "strobe: config error: " + cfg +
                       ": the YAML expands to more than 100000 nodes (aliases that nest aliases?); a config this large is refused\n");
  EXPECT_FALSE(std::filesystem::exists(dir + "/run"));
}

TEST(CliBadInput, DirectoryEmptyFileAndDuplicateKeysSaySo) {
  const std::string dir = temp_dir("cfgdir");
  auto r = strobe_cmd("fit -c " + dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe: config error: " + dir + ": is a directory, not a config file\n");
  const std::string empty = dir + "/empty.yaml";
  std::ofstream(empty) << "# nothing yet\n";
  r = strobe_cmd("fit -c " + empty);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe: config error: " + empty + ": the config is empty (expected a mapping with at least 'model' and 'data')\n");
  const std::string dup = write_config(tiny_yaml("  max_steps: 3\n  max_steps: 5\n"));
  r = strobe_cmd("fit -c " + dup);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe: config error: " + dup + ":10:3: trainer.max_steps: duplicate key (first defined at line 9)\n");
}

TEST(CliBadInput, UnusableRunDirectoryExitsTwoWithOneLine) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string file = temp_dir("rundir") + "/a-file";
  std::ofstream(file) << "x";
  struct Case {
    std::string run_dir, expect;
  } cases[] = {
      {"/proc/strobe-run", "strobe: run directory error: --run-dir /proc/strobe-run: cannot create the run directory ("},
      {file + "/run", "strobe: run directory error: --run-dir " + file + "/run: cannot create the run directory ("},
      {file, "strobe: run directory error: --run-dir " + file + ": exists and is not a directory\n"},
  };
  for (const auto& c : cases) {
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + c.run_dir);
    EXPECT_EQ(r.code, 2) << c.run_dir << "\n" << r.err;
    EXPECT_EQ(r.err.rfind(c.expect, 0), 0u) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
  // The default location under a read-only root (trainer.default_root_dir names where it came from).
  if (::geteuid() != 0) {
    const std::string ro = temp_dir("ro");
    ::chmod(ro.c_str(), 0555);
    auto r = strobe_cmd("fit -c " + cfg + " --set trainer.default_root_dir=" + ro);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find("trainer.default_root_dir: " + ro + "/tiny/version_0: cannot create the run directory"), std::string::npos)
        << r.err;
  }
  auto r = strobe_cmd("fit -c " + cfg + " --set trainer.default_root_dir=" + file);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err.rfind("strobe: run directory error: trainer.default_root_dir: " + file + "/tiny/version_0: cannot create", 0), 0u)
      << r.err;
}

// A run name is one safe path component: '.' and '..' would put the run beside or above
// default_root_dir (runs/../version_0). Refused before anything is written.
TEST(CliBadInput, RunNamesOfDotsAreRefusedAndWriteNothing) {
  const std::string cfg = write_config(tiny_yaml());
  for (const std::string name : {"..", ".", "...."}) {
    const std::string base = temp_dir("runname"), root = base + "/runs";
    std::filesystem::create_directories(root);
    auto r = strobe_cmd("fit -c " + cfg + " --set name=" + name + " --set trainer.default_root_dir=" + root);
    EXPECT_EQ(r.code, 2) << name << "\n" << r.err;
    EXPECT_NE(r.err.find("name: expected a run name of letters, digits, '_', '-', '.' (not dots alone), got '" + name + "'"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    std::vector<std::string> left;
    for (auto& e : std::filesystem::recursive_directory_iterator(base)) left.push_back(e.path().string());
    EXPECT_EQ(left, std::vector<std::string>{root}) << name << ": the run wrote outside or into default_root_dir";
  }
}

TEST(CliBadInput, DataThatDoesNotFitTheModelIsRefusedAtSetup) {
  const std::string cfg = write_config(tiny_yaml());
  struct Case {
    std::string sets, expect;
  } cases[] = {
      {"--set model.num_classes=3",
       "--set model.num_classes=3: model.num_classes: 3 classes, but data.num_classes is 4 (labels up to 3 would be out of range)\n"},
      {"--set model.in_features=32",
       "--set model.in_features=32: model.in_features: 32, but the data's images flatten to 1 x 8 x 8 = 64 (data.channels is 1, "
       "data.image_size is 8)\n"},
      {"--set 'model={name: resnet, depth: 18, width: 8, num_classes: 4, in_channels: 3}'",
       "model.in_channels: 3 input channels, but data.channels is 1\n"},
      {"--set 'model={name: vit, img_size: 16, patch_size: 4, in_channels: 1, num_classes: 4, embed_dim: 32, depth: 1, num_heads: 2}'",
       "model.img_size: 16 pixels, but data.image_size is 8\n"},
  };
  for (const auto& c : cases) {
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + temp_dir("mismatch") + " " + c.sets);
    EXPECT_EQ(r.code, 2) << c.sets << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.sets << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("strobe: config error: ", 0), 0u) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
  // The token models: vocabulary and positions.
  const std::string lm = write_config(
      "name: lm\ntrainer:\n  device: cpu\n  enable_progress_bar: false\nmodel:\n  name: decoder_lm\n  vocab_size: 64\n"
      "  max_seq_len: 32\n  embed_dim: 16\n  depth: 1\n  num_heads: 2\ndata:\n  name: synthetic_tokens\n  vocab_size: 100\n"
      "  max_seq_len: 32\n  num_samples: 8\n");
  auto r = strobe_cmd("fit -c " + lm + " --run-dir " + temp_dir("lm"));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find(lm + ":7:3: model.vocab_size: 64 tokens, but data.vocab_size is 100"), std::string::npos) << r.err;
  r = strobe_cmd("fit -c " + lm + " --run-dir " + temp_dir("lm") + " --set model.vocab_size=100 --set data.max_seq_len=64");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("model.max_seq_len: 32 positions, but data.max_seq_len is 64"), std::string::npos) << r.err;
}

// A llama on data, a task or limits it cannot train on: refused before the first step (exit 2, one
// line naming the key and the value), not at the first step with a low-level message.
TEST(CliBadInput, ALlamaOnDataItCannotReadIsRefusedBeforeTheFirstStep) {
  const std::string dir = temp_dir("llama-misfit");
  const std::string cfg = write_config(
      "name: l\ntrainer:\n  max_steps: 2\n  device: cpu\n  enable_progress_bar: false\nmodel:\n  name: llama\n"
      "  vocab_size: 64\n  embed_dim: 32\n  depth: 1\n  num_heads: 2\n  max_seq_len: 16\ndata:\n  name: synthetic_tokens\n"
      "  vocab_size: 64\n  max_seq_len: 16\n  num_samples: 16\n  batch_size: 4\n  num_workers: 0\n");
  // A token file whose largest id (200) the model's 64-token vocabulary cannot embed, data.vocab_size unset.
  const std::string tokens = dir + "/train.bin";
  {
    std::vector<uint16_t> ids(400);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint16_t>(i % 50);
    ids[123] = 200;
    std::ofstream(tokens, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), ids.size() * 2);
  }
  struct Case {
    std::string sets, expect;
  } cases[] = {
      {"--set 'data={name: synthetic_images, image_size: 8, channels: 1, num_classes: 4, num_samples: 8}'",
       "model.name: 'llama' reads 'tokens' from each batch, but the batches of data 'synthetic_images' hold image, label\n"},
      {"--set task.name=classification",
       "--set task.name=classification: task.name: task 'classification' reads 'label' from each batch, but the batches of "
       "data 'synthetic_tokens' hold tokens, targets\n"},
      {"--set 'data={name: token_file, path: " + tokens + ", max_seq_len: 16, num_workers: 0}'",
       "model.vocab_size: 64 tokens, but the largest token id in " + tokens + " is 200 (token ids up to 200 would be out of range)\n"},
      {"--set trainer.limit_train_batches=0",
       "strobe: config error: trainer.limit_train_batches: leaves none of the 4 training batches to train on (give a count >= 1 "
       "or a fraction > 0)\n"},
  };
  for (const auto& c : cases) {
    const std::string run_dir = dir + "/run";
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + run_dir + " " + c.sets);
    EXPECT_EQ(r.code, 2) << c.sets << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.sets << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("strobe: config error: ", 0), 0u) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_FALSE(std::filesystem::exists(run_dir + "/config.yaml")) << c.sets << ": the run started";
    std::filesystem::remove_all(run_dir);
  }
}

TEST(CliBadInput, ABatchThatCannotFitInMemoryIsRefusedAtSetup) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("huge-batch");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir +
                      " --set data.image_size=256 --set data.channels=3 --set model.in_features=196608"
                      " --set data.num_samples=100000000 --set data.batch_size=50000000");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--set data.batch_size=50000000: data.batch_size: 50000000 samples of 768.0 KiB make a"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("lower data.batch_size"), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/config.yaml"));
}

TEST(CliBadInput, RunningOutOfMemoryDuringTheRunNamesTheBatchSize) {
  // Under an address-space limit the first activation of a wide layer fails to allocate for real
  // (libtorch's CPU allocator): 8192 x 262144 floats = 8 GiB, while the batch itself (8192 x 64
  // floats) passes the setup estimate. The same command with a batch of 8 runs under the same limit.
  const std::string cfg = write_config(tiny_yaml());
  const std::string limit = "ulimit -v 6000000; MALLOC_ARENA_MAX=2 ";
  const std::string sets = " --set model.hidden=[262144] --set data.num_samples=16384 --set data.num_workers=1"
                           " --set data.prefetch_factor=1 --set trainer.max_steps=2";
  auto ok = shell_cmd(limit, "fit -c " + cfg + " --run-dir " + temp_dir("oom-ok") + sets + " --set data.batch_size=8");
  ASSERT_EQ(ok.code, 0) << "control run under the same limit failed:\n" << ok.err;
  auto r = shell_cmd(limit, "fit -c " + cfg + " --run-dir " + temp_dir("oom") + sets + " --set data.batch_size=8192");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err.rfind("strobe: out of memory on cpu (", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("lower data.batch_size (now 8192)"), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
}

// --- the resolved config --------------------------------------------------------------------

TEST(CliRunFiles, RefusedResumeLeavesConfigYamlAsItWas) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("refused-resume");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=2");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string before = slurp(dir + "/config.yaml");
  ASSERT_NE(before.find("hidden: [32, 16]"), std::string::npos) << before;
  // Another model shape: the checkpoint is refused, and the run's files stay as they were.
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + dir + "/checkpoints/last.ckpt --set model.hidden=[8]");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(slurp(dir + "/config.yaml"), before);
  for (const auto& e : std::filesystem::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  // A resume that starts rewrites it with the continuation's settings.
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + dir + "/checkpoints/last.ckpt --set trainer.max_steps=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(slurp(dir + "/config.yaml").find("max_steps: 3"), std::string::npos);
}

TEST(CliRunFiles, ResolvedConfigReusedAsTheConfigGivesTheSameExperiment) {
  // val_check_interval 0.5 and the defaults 1.0 must stay fractions; precision "32" a string.
  const std::string cfg = write_config(tiny_yaml("  precision: \"32\"\n  val_check_interval: 1.0\n"));
  const std::string a = temp_dir("resolved-a");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + a);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string resolved = slurp(a + "/config.yaml");
  EXPECT_NE(resolved.find("precision: \"32\""), std::string::npos) << resolved;
  EXPECT_NE(resolved.find("limit_train_batches: 1.0"), std::string::npos) << resolved;
  const std::string b = temp_dir("resolved-b");
  r = strobe_cmd("fit -c " + a + "/config.yaml --run-dir " + b);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(slurp(b + "/config.yaml"), resolved);
  // The same batches and validations: the same metrics, row for row.
  EXPECT_EQ(slurp(b + "/metrics.csv"), slurp(a + "/metrics.csv"));
}

TEST(CliRunFiles, StaleTempFilesOfAKilledWriterAreRemovedAtStart) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("stale-tmp");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=2");
  ASSERT_EQ(r.code, 0) << r.err;
  // pid 2^31 - 1 is above any pid_max: that writer is surely dead. This test process is alive.
  const std::string dead = dir + "/checkpoints/.last.ckpt.tmp.2147483647";
  const std::string dead_cfg = dir + "/.config.yaml.tmp.2147483647";
  const std::string live = dir + "/checkpoints/.step=9.ckpt.tmp." + std::to_string(::getpid());
  for (const auto& p : {dead, dead_cfg, live}) std::ofstream(p) << "partial";
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + dir + "/checkpoints/last.ckpt --set trainer.max_steps=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_FALSE(std::filesystem::exists(dead_cfg));
  EXPECT_TRUE(std::filesystem::exists(live)) << "a live writer's temp file was removed";
  EXPECT_NE(r.err.find("strobe: removed 1 partial checkpoint(s) a killed writer left in " + dir + "/checkpoints"), std::string::npos)
      << r.err;
}

TEST(CliRunFiles, MetricsCsvHasOneRowPerStep) {
  const std::string cfg = write_config(logged_yaml());
  const std::string dir = temp_dir("csv-rows");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  std::ifstream in(dir + "/metrics.csv");
  std::string header;
  std::getline(in, header);
  EXPECT_EQ(header.rfind("step,epoch,", 0), 0u) << header;
  std::vector<int64_t> steps;
  for (std::string line; std::getline(in, line);) steps.push_back(std::stoll(line.substr(0, line.find(','))));
  ASSERT_EQ(steps.size(), 24u);  // 2 epochs x 12 batches, every step logged
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i], static_cast<int64_t>(i + 1)) << "row " << i;
  // The validation after step 6 (half an epoch) shares the row of step 6 with the loss and lr.
  auto loss = read_csv(dir + "/metrics.csv", "train/loss"), lr = read_csv(dir + "/metrics.csv", "lr"),
       val = read_csv(dir + "/metrics.csv", "val/acc");
  EXPECT_EQ(loss.size(), 24u);
  EXPECT_EQ(lr.size(), 24u);
  EXPECT_EQ(val.size(), 4u);
  EXPECT_TRUE(val.count(6) && val.count(12) && val.count(18) && val.count(24));
}

// --- the console ----------------------------------------------------------------------------

TEST(CliConsole, ProgressBarFitsANarrowTerminal) {
  const std::string cfg = write_config(tiny_yaml() + "callbacks:\n  - name: progress_bar\n    mode: tty\n");
  const std::string dir = temp_dir("narrow");
  auto r = shell_cmd("COLUMNS=50 ", "fit -c " + cfg + " --run-dir " + dir + " --set trainer.enable_progress_bar=true");
  ASSERT_EQ(r.code, 0) << r.err;
  int redraws = 0;
  for (const std::string& piece : split_any(r.out, "\r\n")) {
    std::string visible = std::regex_replace(piece, std::regex("\x1b\\[K"), "");
    if (visible.rfind("epoch ", 0) != 0) continue;
    ++redraws;
    EXPECT_LT(visible.size(), 50u) << "'" << visible << "'";
    EXPECT_NE(visible.find("/12"), std::string::npos) << visible;  // the batch count always stays
  }
  EXPECT_GE(redraws, 2) << r.out;
}

TEST(CliConsole, EpochsAreZeroBasedInBarValidationLineAndCsv) {
  const std::string cfg = write_config(logged_yaml() + "  - name: progress_bar\n    mode: plain\n");
  const std::string dir = temp_dir("epochs");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.enable_progress_bar=true");
  ASSERT_EQ(r.code, 0) << r.err;
  std::map<int64_t, int64_t> csv_epoch;  // step -> epoch
  {
    std::ifstream in(dir + "/metrics.csv");
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      auto c1 = line.find(','), c2 = line.find(',', c1 + 1);
      csv_epoch[std::stoll(line.substr(0, c1))] = std::stoll(line.substr(c1 + 1, c2 - c1 - 1));
    }
  }
  std::smatch m;
  int bar = 0, val = 0;
  for (const std::string& line : split_any(r.out, "\n")) {
    if (std::regex_search(line, m, std::regex(R"(^epoch (\d+) \((\d) of 2\) batch \d+/12 step (\d+) )"))) {
      EXPECT_EQ(std::stoll(m[2]), std::stoll(m[1]) + 1) << line;
      EXPECT_EQ(std::stoll(m[1]), csv_epoch.at(std::stoll(m[3]))) << line;
      ++bar;
    } else if (std::regex_search(line, m, std::regex(R"(^validation at epoch (\d+) step (\d+):)"))) {
      EXPECT_EQ(std::stoll(m[1]), csv_epoch.at(std::stoll(m[2]))) << line;
      ++val;
    }
  }
  EXPECT_EQ(bar, 24) << r.out;
  EXPECT_EQ(val, 4) << r.out;
  EXPECT_EQ(csv_epoch.at(1), 0);
  EXPECT_EQ(csv_epoch.at(24), 1);
}

TEST(CliConsole, FitEndsWithASummary) {
  const std::string cfg = write_config(logged_yaml());
  const std::string dir = temp_dir("summary");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(strobe fit: finished at step 24, epoch 1 in [0-9.]+ s \(trainer.max_epochs: 2 reached\)\n)"))) << r.out;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(  final metrics:.* train/loss=([-0-9.e]+).* val/acc=([-0-9.e]+))"))) << r.out;
  const auto loss = read_csv(dir + "/metrics.csv", "train/loss");
  EXPECT_NEAR(std::stod(m[1]), std::stod(loss.rbegin()->second.at("train/loss")), 1e-5);
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(  best checkpoint: (\S+) \(val/acc=([-0-9.e]+)\))"))) << r.out;
  EXPECT_TRUE(std::filesystem::exists(m[1].str())) << m[1];
  EXPECT_NE(m[1].str().find(dir + "/checkpoints/epoch="), std::string::npos) << m[1];
  double best = 0;
  for (const auto& kv : read_csv(dir + "/metrics.csv", "val/acc")) best = std::max(best, std::stod(kv.second.at("val/acc")));
  EXPECT_NEAR(std::stod(m[2]), best, 1e-4);
  EXPECT_NE(r.out.find("  last checkpoint: " + dir + "/checkpoints/last.ckpt\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  run directory: " + dir + "\n"), std::string::npos) << r.out;
}

// Every load of weights is strict: a deeper ResNet's checkpoint (all of depth 18's tensors are in
// it, with their shapes) into a depth-18 config is refused by validate, test and resume alike, naming
// the config key, instead of scoring a partly loaded model.
TEST(CliCheckpoint, WeightsOfAnotherModelAreRefusedNamingTheConfigKey) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("deeper");
  const std::string resnet = " --set 'model={name: resnet, depth: DEPTH, width: 4, num_classes: 4, in_channels: 1}'";
  auto with_depth = [&](const std::string& d) { return std::regex_replace(resnet, std::regex("DEPTH"), d); };
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=1" + with_depth("34"));
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = dir + "/checkpoints/last.ckpt";
  const std::string why = "the checkpoint's weights do not fit this model: model.depth: checkpoint 34, config 18 (unexpected '";
  for (const std::string verb : {"validate", "test"}) {
    r = strobe_cmd(verb + " -c " + cfg + " --ckpt " + ckpt + with_depth("18"));
    EXPECT_EQ(r.code, 2) << verb << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("strobe: checkpoint error: " + ckpt + ": " + why, 0), 0u) << verb << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_EQ(r.out.find("val/"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("test/"), std::string::npos) << r.out;
  }
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + ckpt + " --set trainer.max_steps=2" + with_depth("18"));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err.rfind("strobe: checkpoint error: " + ckpt + ": cannot resume with this config: " + why, 0), 0u) << r.err;
  EXPECT_EQ(r.err.find("group"), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  // The same model still loads.
  r = strobe_cmd("validate -c " + cfg + " --ckpt " + ckpt + with_depth("34"));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("val/loss"), std::string::npos) << r.out;
}

// Names of the files in `dir`, sorted ("" entries for none).
std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The top-k list is relative to the run directory: a copied run resumes with its own files and never
// deletes the original's; a moved run still rotates its own; the summary points inside the new one.
TEST(CliCheckpoint, CopiedAndMovedRunsKeepTheirOwnTopK) {
  const std::string cfg = write_config(tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    save_top_k: 1\n");
  const std::string root = temp_dir("copied");
  const std::string a = root + "/a", b = root + "/b", c = root + "/c";
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + a);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<std::string> a_files = {"epoch=1-step=24.ckpt", "last.ckpt"};
  ASSERT_EQ(files_in(a + "/checkpoints"), a_files);
  const std::string a_best = slurp(a + "/checkpoints/epoch=1-step=24.ckpt");
  std::filesystem::copy(a, b, std::filesystem::copy_options::recursive);

  r = strobe_cmd("fit -c " + cfg + " --ckpt " + b + "/checkpoints/last.ckpt --set trainer.max_epochs=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(files_in(a + "/checkpoints"), a_files);
  EXPECT_EQ(slurp(a + "/checkpoints/epoch=1-step=24.ckpt"), a_best);
  EXPECT_EQ(files_in(b + "/checkpoints"), (std::vector<std::string>{"epoch=2-step=36.ckpt", "last.ckpt"}));
  EXPECT_NE(r.out.find("  latest checkpoint: " + b + "/checkpoints/epoch=2-step=36.ckpt\n"), std::string::npos) << r.out;

  std::filesystem::rename(b, c);
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + c + "/checkpoints/last.ckpt --set trainer.max_epochs=4");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(files_in(c + "/checkpoints"), (std::vector<std::string>{"epoch=3-step=48.ckpt", "last.ckpt"}));
  EXPECT_NE(r.out.find("  latest checkpoint: " + c + "/checkpoints/epoch=3-step=48.ckpt\n"), std::string::npos) << r.out;
  EXPECT_EQ(files_in(a + "/checkpoints"), a_files);
}

// A dirpath outside the run directory is the user's: a copied run deletes there only what it wrote.
TEST(CliCheckpoint, OutsideTheRunDirectoryOnlyThisRunsFilesAreDeleted) {
  const std::string root = temp_dir("outside");
  const std::string shared = root + "/shared", x = root + "/x", y = root + "/y";
  const std::string cfg =
      write_config(tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    save_top_k: 1\n    dirpath: " + shared + "\n");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + x);
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_EQ(files_in(shared), (std::vector<std::string>{".strobe-owner", "epoch=1-step=24.ckpt", "last.ckpt"}));
  std::filesystem::copy(x, y, std::filesystem::copy_options::recursive);
  // The copy continues the series from the shared last.ckpt (a resume from the directory takes it
  // over; its run directory holds the copied run, so --overwrite).
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + shared + "/last.ckpt --run-dir " + y + " --overwrite --set trainer.max_epochs=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(files_in(shared), (std::vector<std::string>{".strobe-owner", "epoch=1-step=24.ckpt", "epoch=2-step=36.ckpt", "last.ckpt"}));
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + shared + "/last.ckpt --run-dir " + y + " --overwrite --set trainer.max_epochs=4");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(files_in(shared), (std::vector<std::string>{".strobe-owner", "epoch=1-step=24.ckpt", "epoch=3-step=48.ckpt", "last.ckpt"}));
}

// A dirpath outside the run directory is claimed as the run directory is: never inside another
// run's directory, locked while its run lives, and holding one run's checkpoints: another run is
// refused unless it resumes from there or passes --overwrite.
TEST(CliCheckpoint, AnOutsideDirectoryIsClaimedLikeARunDirectory) {
  namespace fs = std::filesystem;
  const std::string root = temp_dir("ckptclaim");
  const std::string a = root + "/a", b = root + "/b", shared = root + "/shared";
  auto cfg_at = [&](const std::string& dirpath) {
    return write_config(tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    dirpath: " + dirpath + "\n");
  };
  auto fit = [&](const std::string& cfg, const std::string& run, const std::string& extra = "") {
    return strobe_cmd("fit -c " + cfg + " --run-dir " + run + " --set trainer.max_steps=2" + extra);
  };
  ASSERT_EQ(fit(write_config(tiny_yaml()), a).code, 0);
  const std::string a_last = slurp(a + "/checkpoints/last.ckpt");
  // Another run's checkpoints/, its run directory, a directory inside it: refused, nothing written,
  // the refused run's own directory released.
  for (const std::string& into : {a + "/checkpoints", a, a + "/checkpoints/sub"}) {
    auto r = fit(cfg_at(into), b);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_EQ(r.err, "strobe: run directory error: callbacks[0].dirpath: " + into + ": lies in the run directory " + a +
                         " of another run; give the checkpoints a directory of their own\n");
    EXPECT_FALSE(fs::exists(b));
  }
  EXPECT_FALSE(fs::exists(a + "/checkpoints/sub"));
  EXPECT_EQ(slurp(a + "/checkpoints/last.ckpt"), a_last);

  // A directory holding another run's checkpoints.
  const std::string cfg = cfg_at(shared);
  ASSERT_EQ(fit(cfg, root + "/c").code, 0);
  EXPECT_EQ(slurp(shared + "/.strobe-owner"), "run_dir=" + root + "/c\n");
  const std::string c_last = slurp(shared + "/last.ckpt");
  auto r = fit(cfg, b);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err, "strobe: run directory error: callbacks[0].dirpath: " + shared + ": holds the checkpoints of the run " +
                       root + "/c (last.ckpt); to continue it pass --ckpt " + shared +
                       "/last.ckpt, to start over in it pass --overwrite, or choose another directory\n");
  EXPECT_EQ(slurp(shared + "/last.ckpt"), c_last);
  EXPECT_FALSE(fs::exists(b));
  // Checkpoints of no known run (the owner file gone) are refused as well.
  fs::rename(shared + "/.strobe-owner", root + "/owner");
  r = fit(cfg, b);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find(": holds the checkpoints of another run (last.ckpt); "), std::string::npos) << r.err;
  fs::rename(root + "/owner", shared + "/.strobe-owner");

  // While a run holds the directory (or a directory above it) it is locked.
  {
    const int fd = ::open(shared.c_str(), O_RDONLY | O_DIRECTORY);
    ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
    r = fit(cfg, b, " --overwrite");
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_EQ(r.err, "strobe: run directory error: callbacks[0].dirpath: " + shared +
                         ": another run is writing checkpoints to this directory (it stays locked while that run lives); "
                         "wait for it to end or choose another directory\n");
    r = fit(cfg_at(shared + "/sub"), b);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_EQ(r.err, "strobe: run directory error: callbacks[0].dirpath: " + shared + "/sub: lies in " + shared +
                         ", which a live run is writing to; give the checkpoints a directory of their own\n");
    ::close(fd);
  }
  EXPECT_EQ(slurp(shared + "/last.ckpt"), c_last);
  EXPECT_FALSE(fs::exists(shared + "/sub"));

  // A resume from the directory takes the series over.
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + root + "/d --ckpt " + shared + "/last.ckpt --set trainer.max_steps=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(slurp(shared + "/.strobe-owner"), "run_dir=" + root + "/d\n");
  // --overwrite starts over in it: the old checkpoints go, the user's files stay.
  std::ofstream(shared + "/notes.txt") << "mine\n";
  r = fit(cfg, b, " --overwrite --set trainer.max_steps=1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(files_in(shared), (std::vector<std::string>{".strobe-owner", "last.ckpt", "notes.txt"}));
  EXPECT_EQ(slurp(shared + "/.strobe-owner"), "run_dir=" + b + "\n");
  EXPECT_NE(checkpoint::load_checkpoint_file(shared + "/last.ckpt").blob("meta").find("\"global_step\":1,"), std::string::npos);

  // A project directory holding the user's config.yaml is no run directory: its checkpoints/ is
  // claimed, and resumed from.
  const std::string proj = root + "/proj";
  fs::create_directories(proj);
  fs::copy_file(cfg_at(proj + "/checkpoints"), proj + "/config.yaml");
  ASSERT_EQ(fit(proj + "/config.yaml", root + "/e").code, 0);
  r = fit(proj + "/config.yaml", root + "/f", " --ckpt " + proj + "/checkpoints/last.ckpt --set trainer.max_steps=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(slurp(proj + "/checkpoints/.strobe-owner"), "run_dir=" + root + "/f\n");
}

// --- the run directory: claimed, locked, never another run's -----------------------------------

// Eight fits started at once under one default_root_dir: eight version directories, each holding
// its own run's config (each run has its own seed).
TEST(CliRunDir, ConcurrentFitsEachClaimTheirOwnVersion) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string root = temp_dir("concurrent");
  std::string cmd;
  for (int i = 0; i < 8; ++i)
    cmd += fmt::format("({} fit -c {} --set trainer.default_root_dir={}/runs --set trainer.max_steps=1 "
                       "--set trainer.num_sanity_val_steps=0 --set seed={} > {}/out{} 2>&1) & ",
                       bin(), cfg, root, 100 + i, root, i);
  ASSERT_EQ(std::system((cmd + "wait").c_str()), 0);
  std::set<std::string> dirs;
  for (int i = 0; i < 8; ++i) {
    const std::string out = slurp(root + "/out" + std::to_string(i));
    std::smatch m;
    ASSERT_TRUE(std::regex_search(out, m, std::regex("strobe fit: run directory (\\S+) "))) << out;
    dirs.insert(m[1]);
    EXPECT_NE(slurp(m[1].str() + "/config.yaml").find("\nseed: " + std::to_string(100 + i) + "\n"), std::string::npos)
        << m[1] << "\n" << slurp(m[1].str() + "/config.yaml");
    EXPECT_NE(out.find("strobe fit: finished at step 1"), std::string::npos) << out;
  }
  EXPECT_EQ(dirs.size(), 8u);
  EXPECT_EQ(files_in(root + "/runs/tiny"), (std::vector<std::string>{"version_0", "version_1", "version_2", "version_3",
                                                                     "version_4", "version_5", "version_6", "version_7"}));
}

// A directory holding a run is refused (its files untouched) unless the fit resumes that run from a
// checkpoint inside it, or --overwrite clears the run's files (and nothing else) first.
TEST(CliRunDir, ARunDirectoryHoldingARunIsRefusedUnlessResumedOrOverwritten) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string root = temp_dir("occupied");
  const std::string d = root + "/d", e = root + "/e";
  ASSERT_EQ(strobe_cmd("fit -c " + cfg + " --run-dir " + d).code, 0);
  ASSERT_EQ(strobe_cmd("fit -c " + cfg + " --run-dir " + e + " --set trainer.max_steps=2").code, 0);
  const auto before = std::vector<std::string>{slurp(d + "/config.yaml"), slurp(d + "/metrics.csv"),
                                               slurp(d + "/checkpoints/last.ckpt"), slurp(d + "/checkpoints/epoch=1-step=24.ckpt")};
  auto after = [&] {
    return std::vector<std::string>{slurp(d + "/config.yaml"), slurp(d + "/metrics.csv"), slurp(d + "/checkpoints/last.ckpt"),
                                    slurp(d + "/checkpoints/epoch=1-step=24.ckpt")};
  };
  const std::string refusal = "strobe: run directory error: --run-dir " + d +
                              ": already holds a run (checkpoints/epoch=1-step=24.ckpt, checkpoints/last.ckpt, config.yaml and 1 "
                              "more); to continue it pass --ckpt " +
                              d + "/checkpoints/last.ckpt, to start over in it pass --overwrite, or choose another directory\n";
  for (const std::string& extra : {std::string(), " --ckpt " + e + "/checkpoints/last.ckpt"}) {
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + d + " --set trainer.max_steps=30" + extra);
    EXPECT_EQ(r.code, 2) << extra << "\n" << r.err;
    EXPECT_EQ(r.err, refusal) << extra;
    EXPECT_EQ(after(), before) << extra;
  }
  // Its own checkpoint resumes in place.
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + d + " --ckpt " + d + "/checkpoints/last.ckpt --set trainer.max_epochs=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("strobe fit: finished at step 36"), std::string::npos) << r.out;
  // --overwrite: the old run's files go, the user's stay.
  std::ofstream(d + "/notes.txt") << "mine\n";
  ASSERT_TRUE(std::filesystem::exists(d + "/model_summary.txt"));
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + d + " --overwrite --set trainer.max_steps=3 --set trainer.enable_model_summary=false");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(slurp(d + "/notes.txt"), "mine\n");
  EXPECT_FALSE(std::filesystem::exists(d + "/model_summary.txt")) << "the old run's summary stayed";
  EXPECT_EQ(files_in(d + "/checkpoints"), (std::vector<std::string>{"last.ckpt"}));
  EXPECT_EQ(read_csv(d + "/metrics.csv", "train/loss").rbegin()->first, 3);
  EXPECT_EQ(read_csv(d + "/metrics.csv", "train/loss").size(), 3u);
  EXPECT_NE(slurp(d + "/config.yaml").find("  max_steps: 3\n"), std::string::npos);
}

// While a run lives its directory is locked: a second writer is refused (even with --overwrite,
// which then removes nothing); kill -9 of the first leaves no stale lock.
TEST(CliRunDir, ASecondWriterIsRefusedWhileTheFirstRunsAndAKilledRunLeavesNoLock) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string root = temp_dir("locked");
  const std::string d = root + "/d";
  const std::string first = fmt::format("{} fit -c {} --run-dir {} --set trainer.max_epochs=100000 > {}/out 2>&1 & echo $! > {}/pid",
                                        bin(), cfg, d, root, root);
  ASSERT_EQ(std::system(first.c_str()), 0);
  for (int i = 0; i < 600 && !std::filesystem::exists(d + "/metrics.csv"); ++i) ::usleep(100000);
  ASSERT_TRUE(std::filesystem::exists(d + "/metrics.csv")) << slurp(root + "/out");
  const pid_t pid = std::stoi(slurp(root + "/pid"));
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + d + " --overwrite --set trainer.max_steps=2");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err, "strobe: run directory error: --run-dir " + d +
                       ": another run is writing to this run directory (it stays locked while that run lives); wait for it "
                       "to end or choose another directory\n");
  EXPECT_TRUE(std::filesystem::exists(d + "/config.yaml"));
  EXPECT_TRUE(std::filesystem::exists(d + "/metrics.csv"));
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  for (int i = 0; i < 100 && ::kill(pid, 0) == 0; ++i) ::usleep(100000);
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + d + " --overwrite --set trainer.max_steps=2");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(read_csv(d + "/metrics.csv", "train/loss").rbegin()->first, 2);
}

// A version directory claimed by a run that is refused before it writes anything is released.
TEST(CliRunDir, ARefusedRunLeavesNoClaimedVersion) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string root = temp_dir("released");
  ASSERT_EQ(strobe_cmd("fit -c " + cfg + " --run-dir " + root + "/src --set trainer.max_steps=1").code, 0);
  std::filesystem::copy_file(root + "/src/checkpoints/last.ckpt", root + "/other.ckpt");
  auto r = strobe_cmd("fit -c " + cfg + " --ckpt " + root + "/other.ckpt --set trainer.default_root_dir=" + root +
                      "/runs --set model.hidden=[8]");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("cannot resume with this config"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(root + "/runs")) << files_in(root + "/runs/tiny").size();
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + root + "/other.ckpt --set trainer.default_root_dir=" + root +
                 "/runs --set trainer.max_steps=2");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(files_in(root + "/runs/tiny"), (std::vector<std::string>{"version_0"}));
}

// --- the end of a step: validation, then checkpoints --------------------------------------------

namespace {

// Every cell of metrics.csv: step -> column -> text (the epoch column included).
std::map<int64_t, std::map<std::string, std::string>> csv_cells(const std::string& path) {
  std::map<int64_t, std::map<std::string, std::string>> rows;
  std::ifstream in(path);
  std::string header;
  std::getline(in, header);
  const auto cols = split_any(header, ",");
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::stringstream ls(line + ",");
    for (std::string c; std::getline(ls, c, ',');) cells.push_back(c);
    for (size_t i = 1; i < cells.size() && i < cols.size(); ++i)
      if (!cells[i].empty()) rows[std::stoll(cells[0])][cols[i]] = cells[i];
  }
  return rows;
}

// Validation and checkpoints every 3 steps, the learning rate logged, an epoch ending at step 12.
std::string step_end_yaml() {
  return std::regex_replace(tiny_yaml("  val_check_interval: 3\n  max_steps: 15\n"), std::regex("num_sanity_val_steps: 1"), "num_sanity_val_steps: 0") +
         "callbacks:\n  - name: model_checkpoint\n    monitor: val/loss\n    every_n_steps: 3\n    save_top_k: 2\n"
         "  - name: lr_monitor\n";
}

}  // namespace

// A step that validates writes its checkpoint after the validation: the file is named and ranked by
// that step's val/loss, and top-k keeps the files of the best validations.
TEST(CliStepEnd, ACheckpointIsNamedAndRankedByItsOwnStepsValidation) {
  const std::string cfg = write_config(step_end_yaml());
  const std::string dir = temp_dir("named");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto val = read_csv(dir + "/metrics.csv", "val/loss");
  ASSERT_EQ(val.size(), 5u);
  std::vector<std::pair<double, std::string>> ranked;
  for (const auto& [step, cols] : val)
    ranked.emplace_back(std::stod(cols.at("val/loss")), fmt::format("step={}-val_loss={:.4f}.ckpt", step, std::stod(cols.at("val/loss"))));
  std::sort(ranked.begin(), ranked.end());
  std::vector<std::string> expect = {ranked[0].second, ranked[1].second, "last.ckpt"};
  std::sort(expect.begin(), expect.end());
  EXPECT_EQ(files_in(dir + "/checkpoints"), expect);
  EXPECT_NE(r.out.find("  best checkpoint: " + dir + "/checkpoints/" + ranked[0].second + " (val/loss="), std::string::npos) << r.out;
}

// kill -9 at each point of a step's end (a deterministic fault hook, not a sleep), then resume:
// metrics.csv equals an uninterrupted run's, every column (validation and lr included), and the
// resumed run ends with the same checkpoints and the same best one.
TEST(CliStepEnd, KillAtEachPointOfAStepsEndThenResumeLosesNothing) {
  const std::string cfg = write_config(step_end_yaml());
  const std::string straight = temp_dir("straight");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + straight);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto expect = csv_cells(straight + "/metrics.csv");
  ASSERT_EQ(expect.size(), 15u);
  ASSERT_TRUE(expect.at(6).count("val/loss") && expect.at(6).count("lr")) << slurp(straight + "/metrics.csv");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(  best checkpoint: \S+/(step=\S+\.ckpt))"))) << r.out;
  const std::string best = m[1];
  for (const std::string point : {"before_validation@6", "before_checkpoint@6", "after_topk@6", "after_checkpoint@6",
                                  "before_checkpoint@12", "after_checkpoint@12"}) {
    const std::string dir = temp_dir("killed");
    r = shell_cmd("STROBE_FAULT_AT=" + point + " ", "fit -c " + cfg + " --run-dir " + dir);
    ASSERT_EQ(r.code, 128 + SIGKILL) << point << "\n" << r.err;
    r = strobe_cmd("fit -c " + cfg + " --ckpt " + dir + "/checkpoints/last.ckpt");
    ASSERT_EQ(r.code, 0) << point << "\n" << r.err;
    EXPECT_EQ(csv_cells(dir + "/metrics.csv"), expect) << point << "\n" << slurp(dir + "/metrics.csv");
    EXPECT_EQ(files_in(dir + "/checkpoints"), files_in(straight + "/checkpoints")) << point;
    EXPECT_NE(r.out.find("  best checkpoint: " + dir + "/checkpoints/" + best), std::string::npos) << point << "\n" << r.out;
  }
}

// --- resume compatibility -------------------------------------------------------------------

TEST(CliResume, IncompatibleChangesAreRefusedNamingEach) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("resume-compat");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=2");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = dir + "/checkpoints/last.ckpt";
  struct Case {
    std::string sets, expect;
  } cases[] = {
      {"--set optimizer.name=sgd",
       ": cannot resume with this config: optimizer.name: adamw -> sgd (the optimizer state (moments, step counts) belongs to "
       "the other optimizer)"},
      {"--set trainer.precision=bf16-mixed", ": cannot resume with this config: trainer.precision: 32 -> bf16-mixed ("},
      {"--set model.hidden=[8]",
       ": cannot resume with this config: the checkpoint's weights do not fit this model: model.hidden: checkpoint [32, 16], "
       "config [8] (unexpected 'fc1.bias' (and 1 more); 'fc0.bias' is [32] in the checkpoint, [8] in the model (and 2 more "
       "mis-shaped))"},
      {"--set optimizer.name=sgd --set trainer.max_steps=5",
       "(the optimizer state (moments, step counts) belongs to the other optimizer) (allowed changes: "},
      // The optimizer's state would restore the checkpoint's lr: a new one is refused, not ignored.
      {"--set optimizer.lr=0.005",
       ": cannot resume with this config: optimizer.lr: 0.01 -> 0.005 (a resumed optimizer keeps the checkpoint's "
       "hyper-parameters; to train with new ones, start a new run from these weights)"},
  };
  for (const auto& c : cases) {
    r = strobe_cmd("fit -c " + cfg + " --ckpt " + ckpt + " " + c.sets);
    EXPECT_EQ(r.code, 2) << c.sets << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("strobe: checkpoint error: " + ckpt + ": cannot resume with this config: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.sets << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_EQ(r.err.find("INTERNAL ASSERT"), std::string::npos) << r.err;
  }
  // max_steps and logging may change: listed, and the run continues.
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + ckpt + " --set trainer.max_steps=4 --set trainer.log_every_n_steps=2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("strobe fit: resuming from " + ckpt + " (step 2) with changes: "
                       "trainer.log_every_n_steps: 1 -> 2, trainer.max_steps: 2 -> 4\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("strobe fit: finished at step 4"), std::string::npos) << r.out;
}
