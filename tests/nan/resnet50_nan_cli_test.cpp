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
    EXPECT_NE(refused.log.find("strobe: config error: --report " + target + ": is the capture"), std::string::npos)
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

}  // namespace
