// The seed's NaN workload end to end through the real executable (configs/cpu/resnet50_nan.yaml:
// per-class BCE divided by each class's count, +Inf when a class is missing from a batch):
// `strobe fit` stops with exit 3 and writes nan/; `strobe replay` reproduces the step exactly and
// names the division in the loss; the captured weights equal those of a run stopped one step
// before the failure.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/safetensors.h"
#include "strobe/core/capture.h"
#include "tests/source_path.h"
#include "tests/test_dirs.h"

namespace {

namespace fs = std::filesystem;

struct Result {
  int status = -1;
  std::string log;
};

Result sh(const std::string& cmd, const fs::path& log) {
  int raw = std::system((cmd + " > " + log.string() + " 2>&1").c_str());
  Result r;
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  std::ifstream in(log);
  r.log.assign(std::istreambuf_iterator<char>(in), {});
  return r;
}

std::string strobe_bin() {
  const char* bin = std::getenv("STROBE_BIN");
  return bin ? bin : "";
}

TEST(NanCaptureCli, ResNet50PerClassBCEStopsWithACaptureThatReplaysExactlyAndNamesTheDivision) {
  const std::string bin = strobe_bin();
  ASSERT_TRUE(!bin.empty() && fs::exists(bin)) << "STROBE_BIN must name the strobe executable (set by ctest)";
  const fs::path base = strobe::testing::new_test_dir("strobe-tests", "r50nan");
  const std::string config = strobe::testing::source_path("configs/cpu/resnet50_nan.yaml");

  auto fit = sh(bin + " fit -c " + config + " --run-dir " + (base / "run").string() + " --set trainer.enable_progress_bar=false",
                base / "fit.log");
  ASSERT_EQ(fit.status, 3) << fit.log;
  EXPECT_NE(fit.log.find("strobe replay"), std::string::npos) << fit.log;
  const std::string cap = strobe::capture::resolve_capture_dir((base / "run" / "nan").string());
  EXPECT_TRUE(fs::exists(fs::path(cap) / "summary.txt"));
  EXPECT_TRUE(fs::exists(fs::path(cap) / "config.yaml"));
  auto d = strobe::checkpoint::load_checkpoint_file(cap + "/" + strobe::capture::kCheckpointFile);
  auto info = nlohmann::json::parse(d.blob("capture"));
  const int64_t step = info["global_step"].get<int64_t>();
  EXPECT_TRUE(info["loss_nonfinite"].get<bool>()) << info.dump(2);

  auto replay = sh(bin + " replay " + (base / "run" / "nan").string() + " --report " + (base / "report.json").string(),
                   base / "replay.log");
  ASSERT_EQ(replay.status, 0) << replay.log;
  EXPECT_NE(replay.log.find("EXACT"), std::string::npos) << replay.log;
  nlohmann::json report;
  std::ifstream(base / "report.json") >> report;
  EXPECT_TRUE(report["exact"].get<bool>()) << report.dump(2);
  ASSERT_FALSE(report["first_nonfinite"].is_null()) << report.dump(2);
  EXPECT_EQ(report["first_nonfinite"]["op"], "aten::div") << report.dump(2);
  EXPECT_EQ(report["first_nonfinite"]["module"], "task.loss") << report.dump(2);
  EXPECT_EQ(report["first_nonfinite"]["phase"], "forward");
  EXPECT_EQ(report["global_step"].get<int64_t>(), step);

  // --diagnose: the per-class BCE's division by a class count of zero is the loss's arithmetic.
  auto diag = sh(bin + " replay " + (base / "run" / "nan").string() + " --diagnose --report " + (base / "diag.json").string(),
                 base / "diag.log");
  ASSERT_EQ(diag.status, 0) << diag.log;
  EXPECT_NE(diag.log.find("verdict: loss"), std::string::npos) << diag.log;
  nlohmann::json dj;
  std::ifstream(base / "diag.json") >> dj;
  EXPECT_EQ(dj["verdict"], "loss") << dj.dump(2);
  EXPECT_NE(dj["evidence"][0].get<std::string>().find("aten::div in task.loss (forward)"), std::string::npos) << dj.dump(2);

  // The report never replaces an input: the capture's own files and its directory are refused, exit 2,
  // before anything runs, and the capture stays as it was.
  const std::string ckpt_file = cap + "/" + strobe::capture::kCheckpointFile;
  std::ifstream before_in(ckpt_file, std::ios::binary);
  const std::string before((std::istreambuf_iterator<char>(before_in)), {});
  for (const std::string& target : {ckpt_file, cap + "/config.yaml", cap, (base / "run" / "nan").string()}) {
    auto refused = sh(bin + " replay " + (base / "run" / "nan").string() + " --report " + target, base / "refused.log");
    EXPECT_EQ(refused.status, 2) << target << "\n" << refused.log;
    const bool dir = fs::is_directory(target);
    EXPECT_NE(refused.log.find("strobe replay: --report " + target + (dir ? ": is a directory" : ": lies in the capture directory")),
              std::string::npos)
        << refused.log;
    EXPECT_EQ(std::count(refused.log.begin(), refused.log.end(), '\n'), 1) << refused.log;
  }
  std::ifstream after_in(ckpt_file, std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(after_in)), {}), before) << "the capture was changed";

  // A run stopped one step before the failure holds the same weights and BatchNorm statistics.
  auto ref = sh(bin + " fit -c " + config + " --run-dir " + (base / "ref").string() +
                    " --set trainer.enable_progress_bar=false --set callbacks=[] --set trainer.max_steps=" + std::to_string(step),
                base / "ref.log");
  ASSERT_EQ(ref.status, 0) << ref.log;
  auto r = strobe::checkpoint::load_checkpoint_file((base / "ref" / "checkpoints" / "last.ckpt").string());
  int compared = 0;
  for (const auto& [k, t] : r.tensors) {
    if (k.rfind("model/", 0) != 0) continue;
    ASSERT_TRUE(d.tensors.count(k)) << k;
    EXPECT_TRUE(torch::equal(t, d.tensors.at(k))) << k << " differs from the run stopped at step " << step;
    ++compared;
  }
  EXPECT_GT(compared, 100);

  // Bad input: one line, exit 2.
  auto bad = sh(bin + " replay " + (base / "ref").string(), base / "bad.log");
  EXPECT_EQ(bad.status, 2) << bad.log;
  EXPECT_NE(bad.log.find("not a NaN capture"), std::string::npos) << bad.log;
  auto bad_dev = sh(bin + " replay " + (base / "run" / "nan").string() + " --device tpu", base / "bad_dev.log");
  EXPECT_EQ(bad_dev.status, 2) << bad_dev.log;
}

// docs/NAN_CAPTURE.md's investigation, through the executable: a regression whose training data
// holds one outlier target. fit catches the loss spike (exit 3), replay --diagnose says data, --bisect
// names the one sample and writes a quarantine, and the run resumed with data.exclude finishes
// (resumed without it, the sample spikes again in the next epoch). Bad input is one line, exit 2.
TEST(NanCaptureCli, SpikeDiagnoseBisectQuarantineResume) {
  const std::string bin = strobe_bin();
  ASSERT_TRUE(!bin.empty() && fs::exists(bin)) << "STROBE_BIN must name the strobe executable (set by ctest)";
  const fs::path base = strobe::testing::new_test_dir("strobe-tests", "walkthrough");
  torch::manual_seed(0);
  auto x = torch::randn({512, 8});
  auto y = x.mm(torch::randn({8, 1})) + 0.01 * torch::randn({512, 1});
  y[325][0] = 1000.0;  // one bad sample: batch 10 of an unshuffled epoch, step 11
  strobe::safetensors::write_file((base / "reg.safetensors").string(), {{"x", x}, {"y", y}});
  const std::string config = strobe::testing::source_path("configs/regression_tensor_file.yaml");
  const std::string run = (base / "run").string();
  const std::string sets = " --set data.path=" + (base / "reg.safetensors").string() +
                           " --set data.shuffle=false --set data.batch_size=32 --set trainer.max_epochs=2 --set trainer.device=cpu"
                           " --set trainer.enable_progress_bar=false --set 'callbacks=[{name: nan_capture, spike: {window: 16, warmup: 8}}]'";
  auto fit = sh(bin + " fit -c " + config + " --run-dir " + run + sets, base / "fit.log");
  ASSERT_EQ(fit.status, 3) << fit.log;
  EXPECT_NE(fit.log.find("nan_capture: loss spike "), std::string::npos) << fit.log;
  EXPECT_NE(fit.log.find(" at step 11 (epoch 0, batch 10)"), std::string::npos) << fit.log;

  auto diag = sh(bin + " replay " + run + "/nan --diagnose", base / "diag.log");
  ASSERT_EQ(diag.status, 0) << diag.log;
  EXPECT_NE(diag.log.find("verdict: data"), std::string::npos) << diag.log;

  const std::string q = (base / "quarantine.json").string();
  auto bis = sh(bin + " replay " + run + "/nan --bisect --write-quarantine " + q + " --report " + (base / "bisect.json").string(),
                base / "bisect.log");
  ASSERT_EQ(bis.status, 0) << bis.log;
  nlohmann::json br;
  std::ifstream(base / "bisect.json") >> br;
  ASSERT_EQ(br["samples"].size(), 1u) << br.dump(2);
  EXPECT_EQ(br["samples"][0]["dataset_index"], 325) << br.dump(2);
  EXPECT_FALSE(br["rest_bad"].get<bool>()) << "the batch without the sample is not a spike";
  EXPECT_NE(bis.log.find("dataset index 325 (train split"), std::string::npos) << bis.log;
  nlohmann::json qj;
  std::ifstream(q) >> qj;
  ASSERT_EQ(qj["samples"].size(), 1u) << qj.dump(2);
  EXPECT_EQ(qj["samples"][0]["index"], 325);
  EXPECT_EQ(qj["samples"][0]["split"], "train");

  // Resumed without the quarantine, epoch 1 meets the sample again; with it, the run finishes.
  const std::string last = run + "/checkpoints/last.ckpt";
  ASSERT_TRUE(fs::exists(last));
  fs::copy_file(last, base / "last.ckpt");
  auto again = sh(bin + " fit -c " + config + " --ckpt " + last + sets, base / "again.log");
  EXPECT_EQ(again.status, 3) << again.log;
  EXPECT_NE(again.log.find("nan_capture: loss spike "), std::string::npos) << again.log;
  fs::copy_file(base / "last.ckpt", last, fs::copy_options::overwrite_existing);
  auto resumed = sh(bin + " fit -c " + config + " --ckpt " + last + sets + " --set data.exclude=" + q, base / "resumed.log");
  EXPECT_EQ(resumed.status, 0) << resumed.log;
  EXPECT_NE(resumed.log.find("data.exclude: 1 sample(s) of the training data left out from epoch 1 on (resumed mid-way through epoch 0)"),
            std::string::npos)
      << resumed.log;
  EXPECT_EQ(resumed.log.find("loss spike"), std::string::npos) << resumed.log;

  // Bad input: one line, exit 2, before any work.
  std::ofstream(base / "bad_q.json") << R"({"strobe_quarantine": 1, "samples": [{"split": "train", "index": 5000}]})";
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"fit -c " + config + sets + " --run-dir " + (base / "b1").string() + " --set data.exclude=" + (base / "bad_q.json").string(),
       "index 5000 of the train split does not exist (it holds"},
      {"fit -c " + config + sets + " --run-dir " + (base / "b2").string() + " --set data.exclude=/nonexistent/q.json",
       "data.exclude: cannot read '/nonexistent/q.json'"},
      {"fit -c " + config + sets + " --run-dir " + (base / "b3").string() + " --set data.exclude=" + config,
       "is not a Strobe quarantine file"},
      {"replay " + run + "/nan --write-quarantine " + q, "--write-quarantine: needs --bisect"},
      {"replay " + run + "/nan --bisect --write-quarantine " + config,
       "--write-quarantine " + config + ": exists and is not a Strobe quarantine file (to add to) (pass --overwrite to replace it)"},
  };
  for (const auto& c : cases) {
    auto r = sh(bin + " " + c.args, base / "bad.log");
    EXPECT_EQ(r.status, 2) << c.args << "\n" << r.log;
    EXPECT_NE(r.log.find(c.expect), std::string::npos) << c.args << "\n" << r.log;
    EXPECT_EQ(std::count(r.log.begin(), r.log.end(), '\n'), 1) << r.log;
  }
}

}  // namespace
