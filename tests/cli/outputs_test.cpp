// The output rule (docs/CONFIG.md, "Outputs"), for every command that writes a file: an input of the
// command is never replaced, --overwrite or not; another existing file only with --overwrite unless
// it is the command's own earlier output; the output's folder is checked before any work. Each
// refusal is one line and exit 2, and the file it names keeps its bytes.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "tests/cli/cli_test_util.h"

namespace strobe::testing {
namespace {

namespace fs = std::filesystem;

// A run of the tiny experiment whose per-class BCE goes non-finite (a class missing from a batch of
// two): its NaN capture is what replay reads.
std::string nan_yaml() {
  std::string y = tiny_yaml();
  const std::string batch = "  batch_size: 8\n";
  y.replace(y.find(batch), batch.size(), "  batch_size: 2\n");
  return y + "task: {name: classification, loss: per_class_bce}\ncallbacks: [{name: nan_capture}]\n";
}

TEST(CliOutputs, NoCommandReplacesItsInputsAndAnotherFileNeedsOverwrite) {
  const fs::path d = temp_dir("outputs");
  const std::string cfg = write_config(tiny_yaml());
  const std::string run = (d / "run").string(), ck = run + "/checkpoints/last.ckpt";
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + run + " --set trainer.max_steps=2");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string nan_cfg = write_config(nan_yaml()), nan_run = (d / "nan_run").string();
  r = strobe_cmd("fit -c " + nan_cfg + " --run-dir " + nan_run);
  ASSERT_EQ(r.code, 3) << r.out << r.err;
  const std::string capture = nan_run + "/nan";
  const std::string captured_config = (fs::directory_iterator(capture)->path() / "config.yaml").string();  // nan/step_<N>/

  // Inputs under other names: the config as cfg.csv, the checkpoint as ck.safetensors, exported
  // weights for model.init_from, a quarantine file named q.csv for data.exclude.
  const std::string cfg_csv = (d / "cfg.csv").string(), ck_st = (d / "ck.safetensors").string();
  fs::copy_file(cfg, cfg_csv);
  fs::copy_file(ck, ck_st);
  const std::string weights = (d / "w.safetensors").string();
  ASSERT_EQ(strobe_cmd("export " + ck + " -o " + weights).code, 0);
  const std::string q_csv = (d / "q.csv").string();
  std::ofstream(q_csv) << R"({"strobe_quarantine": 1, "samples": []})";
  const std::string other = (d / "other.csv").string(), fake_q = (d / "fake_q.json").string();
  std::ofstream(other) << "mine";
  std::ofstream(fake_q) << R"({"strobe_quarantine": true, "samples": []})";  // true is not the marker 1
  const std::string string_index = (d / "string_index.json").string(), scalar_sample = (d / "scalar_sample.json").string();
  std::ofstream(string_index) << R"({"strobe_quarantine": 1, "samples": [{"split": "train", "index": "3"}]})";
  std::ofstream(scalar_sample) << R"({"strobe_quarantine": 1, "samples": [7]})";
  const std::string fifo = (d / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string predict = "predict --split val -c " + cfg + " --ckpt " + ck;
  const std::string too_long = (d / (std::string(300, 'a') + ".csv")).string();

  struct Case {
    std::string args, expect, kept;  // `kept`: a file that keeps its bytes ("" none)
  } cases[] = {
      {"predict --split val -c " + cfg_csv + " --ckpt " + ck + " -o " + cfg_csv + " --overwrite",
       "strobe predict: -o " + cfg_csv + ": is the config file, an input of this command; it is never replaced, --overwrite or not",
       cfg_csv},
      {"predict --split val -c " + cfg + " --ckpt " + ck_st + " -o " + ck_st + " --overwrite",
       ": is the checkpoint being read, an input of this command", ck_st},
      {"predict --split val -c " + cfg + " --set model.init_from=" + weights + " -o " + weights + " --overwrite",
       ": is the file named by model.init_from, an input of this command", weights},
      {predict + " --set data.exclude=" + q_csv + " -o " + q_csv + " --overwrite",
       ": is the file named by data.exclude, an input of this command", q_csv},
      {predict + " -o " + other, "strobe predict: -o " + other + ": exists (pass --overwrite to replace it)", other},
      {predict + " -o " + too_long, ": the name is too long for the file system", ""},
      {predict + " -o " + (d / "none" / "p.csv").string(), ": the directory " + (d / "none").string() + " does not exist", ""},
      // export --names hf: never among a run's files, never the checkpoint's own folder.
      {"export " + ck + " --names hf --overwrite -o " + run, "strobe export: -o " + run + ": holds the checkpoint being exported", ""},
      {"export " + ck + " --names hf --overwrite -o " + run + "/checkpoints", ": holds the checkpoint being exported", ""},
      {"export " + ck + " --names hf --overwrite -o " + nan_run, ": is a run directory (it holds config.yaml)", ""},
      // replay: no --overwrite, no other run's files; the two outputs are two files; never the capture.
      {"replay " + capture + " --report " + ck,
       "strobe replay: --report " + ck + ": exists and is not an earlier replay report (pass --overwrite to replace it)", ck},
      {"replay " + capture + " --report " + run + "/metrics.csv", "exists and is not an earlier replay report", run + "/metrics.csv"},
      {"replay " + capture + " --bisect --report " + other + " --write-quarantine " + other + " --overwrite",
       ": is also the --write-quarantine file; give each output its own file", other},
      {"replay " + capture + " --report " + captured_config + " --overwrite", ": lies in the capture directory", captured_config},
      {"replay " + capture + " --bisect --write-quarantine " + fake_q,
       "--write-quarantine " + fake_q + ": exists and is not a Strobe quarantine file", fake_q},
      {"replay " + capture + " --bisect --write-quarantine " + string_index, "exists and is not a Strobe quarantine file",
       string_index},
      {"replay " + capture + " --bisect --write-quarantine " + scalar_sample, "exists and is not a Strobe quarantine file",
       scalar_sample},
      {"replay " + capture + " --bisect --write-quarantine " + fifo,
       "--write-quarantine " + fifo + ": exists and is not a regular file (a FIFO, a socket or a device)", ""},
      // bench --json: checked before -c is read, never the config; no --overwrite, no other file.
      {"bench step --json " + cfg + " -c " + cfg + " --overwrite", "strobe bench: --json " + cfg + ": is the config file", cfg},
      {"bench step --json " + ck + " -c " + cfg, ": exists and is not an earlier strobe bench result (pass --overwrite", ck},
      // on_exception_checkpoint never writes over the run's checkpoints, and its name is a file name.
      {"fit -c " + cfg + " --run-dir " + (d / "x").string() + " --set 'callbacks=[{name: on_exception_checkpoint, filename: last}]'",
       "callbacks[0].filename: 'last' is a name model_checkpoint gives its checkpoints", ""},
      {"fit -c " + cfg + " --run-dir " + (d / "x").string() +
           " --set 'callbacks=[{name: on_exception_checkpoint, filename: step=2}]'",
       "'step=2' is a name model_checkpoint gives", ""},
      {"fit -c " + cfg + " --run-dir " + (d / "x").string() + " --set \"callbacks=[{name: on_exception_checkpoint, filename: ' '}]\"",
       "callbacks[0].filename: expected a file name without", ""},
      {"fit -c " + cfg + " --run-dir " + (d / "x").string() + " --set 'callbacks=[{name: on_exception_checkpoint, filename: .ckpt}]'",
       "callbacks[0].filename: expected a file name without", ""},
  };
  for (const auto& c : cases) {
    const std::string before = c.kept.empty() ? "" : slurp(c.kept);
    auto res = shell_cmd("timeout 60 ", c.args);  // a command that would block on the FIFO fails, never hangs
    EXPECT_EQ(res.code, 2) << c.args << "\n" << res.err;
    EXPECT_NE(res.err.find(c.expect), std::string::npos) << c.args << "\n" << res.err;
    EXPECT_EQ(count_lines(res.err), 1) << c.args << "\n" << res.err;
    if (!c.kept.empty()) EXPECT_EQ(slurp(c.kept), before) << c.kept << " was changed by " << c.args;
  }
  EXPECT_FALSE(fs::exists(d / "x")) << "a refused fit left its run directory";
  for (const auto& e : fs::directory_iterator(d)) EXPECT_NE(e.path().filename().string()[0], '.') << e.path() << " left behind";
  fs::remove(fifo);

  // What is allowed: --overwrite replaces a file that is no input; a command replaces its own
  // earlier output without it (a replay report, recognised by its marker).
  r = strobe_cmd(predict + " -o " + other + " --overwrite");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(slurp(other).rfind("index,predicted,probability,top5\n", 0), 0u) << slurp(other);
  const std::string report = (d / "r.json").string();
  for (int i = 0; i < 2; ++i) {
    r = strobe_cmd("replay " + capture + " --report " + report);
    ASSERT_EQ(r.code, 0) << i << "\n" << r.err;
  }
  EXPECT_EQ(nlohmann::json::parse(slurp(report)).at("strobe_replay_report"), 1);
}

// data.exclude's reader (the one --write-quarantine adds to): a FIFO is refused, never opened; a
// directory, a deep nesting, a wrong marker, a split or index of the wrong type are one line each.
TEST(CliOutputs, AQuarantineFileThatIsNotOneIsRefusedInOneLine) {
  const fs::path d = temp_dir("quarantine_in");
  const std::string cfg = write_config(tiny_yaml());
  auto file = [&](const std::string& name, const std::string& text) {
    std::ofstream((d / name).string()) << text;
    return (d / name).string();
  };
  const std::string fifo = (d / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  fs::create_directories(d / "dir");
  const std::pair<std::string, std::string> cases[] = {
      {fifo, "data.exclude: '" + fifo + "' is a FIFO, not a regular file"},
      {(d / "dir").string(), "' is a directory, not a regular file"},
      {file("deep.json", std::string(100000, '[')), "' is not a Strobe quarantine file (it nests deeper than 64 levels)"},
      {file("text.json", "not json"), "' is not a Strobe quarantine file (it is not JSON)"},
      {file("true.json", R"({"strobe_quarantine": true, "samples": []})"), "' is not a Strobe quarantine file"},
      {file("split.json", R"({"strobe_quarantine": 1, "samples": [{"split": 5, "index": 1}]})"),
       R"(: a sample without a split of train, val or test: {"index":1,"split":5})"},
      {file("index.json", R"({"strobe_quarantine": 1, "samples": [{"split": "train", "index": 1.5}]})"),
       "a sample without an integer index"},
      {file("big.json", R"({"strobe_quarantine": 1, "samples": [{"split": "train", "index": 18446744073709551615}]})"),
       R"(a sample whose index is not a dataset index (0 to 2^63-1): {"index":18446744073709551615,"split":"train"})"},
  };
  for (const auto& [path, expect] : cases) {
    auto r = shell_cmd("timeout 60 ", "fit -c " + cfg + " --run-dir " + (d / "run").string() + " --set data.exclude=" + path);
    EXPECT_EQ(r.code, 2) << path << "\n" << r.err;
    EXPECT_NE(r.err.find(expect), std::string::npos) << path << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
  EXPECT_FALSE(fs::exists(d / "run"));
  fs::remove(fifo);
}

// What writers killed mid-write (kill -9) leave is removed at the next start: on_exception_checkpoint's
// temporary in <run>/checkpoints even when the run keeps no checkpoints there (enable_checkpointing:
// false), and a NaN capture's temporary folder with the empty step_<N>/ it had claimed.
TEST(CliOutputs, WhatKilledWritersLeaveIsRemovedAtTheNextStart) {
  const fs::path d = temp_dir("outputs_tmp");
  const std::string cfg = write_config(tiny_yaml());
  fs::create_directories(d / "run" / "checkpoints");
  const fs::path stale = d / "run" / "checkpoints" / ".on_exception.ckpt.tmp.4194305";  // above Linux's pid_max
  std::ofstream(stale) << "half a checkpoint";
  fs::create_directories(d / "run" / "nan" / ".step_5.tmp.4194305");
  std::ofstream(d / "run" / "nan" / ".step_5.tmp.4194305" / "capture.ckpt") << "half a capture";
  fs::create_directories(d / "run" / "nan" / "step_5");
  fs::create_directories(d / "run" / "nan" / "step_3");
  std::ofstream(d / "run" / "nan" / "step_3" / "capture.ckpt") << "a whole capture stays";
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + (d / "run").string() +
                      " --set trainer.max_steps=1 --set trainer.enable_checkpointing=false"
                      " --set 'callbacks=[{name: on_exception_checkpoint}, {name: nan_capture}]'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_FALSE(fs::exists(d / "run" / "nan" / ".step_5.tmp.4194305"));
  EXPECT_FALSE(fs::exists(d / "run" / "nan" / "step_5"));
  EXPECT_TRUE(fs::exists(d / "run" / "nan" / "step_3" / "capture.ckpt"));
  EXPECT_NE(r.err.find("nan_capture: removed " + (d / "run" / "nan" / ".step_5.tmp.4194305").string()), std::string::npos) << r.err;
}

}  // namespace
}  // namespace strobe::testing
