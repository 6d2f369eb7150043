// One short `strobe fit` per config family on CPU (configs/cpu/*.yaml), through the real executable.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <gtest/gtest.h>
#include "tests/source_path.h"
#include "tests/test_dirs.h"

namespace {

namespace fs = std::filesystem;

struct FitResult {
  int status = -1;
  fs::path run_dir;
  std::string log;
};

// Skips (returns nullopt) when STROBE_BIN does not name a working strobe executable (a test binary run by hand).
std::optional<std::string> strobe_bin() {
  const char* bin = std::getenv("STROBE_BIN");
  if (!bin || !fs::exists(bin)) return std::nullopt;
  std::string probe = std::string(bin) + " --version 2>&1";
  FILE* p = popen(probe.c_str(), "r");
  char buf[256];
  std::string out;
  while (p && fgets(buf, sizeof buf, p)) out += buf;
  if (p) pclose(p);
  if (out.empty()) return std::nullopt;
  return std::string(bin);
}

FitResult fit(const std::string& bin, const std::string& config, const std::string& tag, const std::string& sets = "") {
  FitResult r;
  const fs::path dir = strobe::testing::new_test_dir("strobe-tests", "fit_" + tag);
  r.run_dir = dir / "run";
  const fs::path log = dir / "fit.log";
  std::string cmd = bin + " fit -c " + strobe::testing::source_path("configs/cpu/" + config) + " --run-dir " +
                    r.run_dir.string() + " --set trainer.enable_progress_bar=false --set trainer.log_every_n_steps=1 " + sets +
                    " > " + log.string() + " 2>&1";
  int raw = std::system(cmd.c_str());
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  std::ifstream in(log);
  r.log.assign(std::istreambuf_iterator<char>(in), {});
  return r;
}

// train/loss of every logged step, in step order (empty cells skipped).
std::vector<double> train_losses(const fs::path& csv) {
  std::ifstream in(csv);
  std::string header;
  std::getline(in, header);
  std::vector<std::string> cols;
  std::stringstream hs(header);
  for (std::string c; std::getline(hs, c, ',');) cols.push_back(c);
  size_t col = std::find(cols.begin(), cols.end(), "train/loss") - cols.begin();
  std::vector<double> out;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::stringstream ls(line + ",");
    for (std::string c; std::getline(ls, c, ',');) cells.push_back(c);
    if (col < cells.size() && !cells[col].empty()) out.push_back(std::stod(cells[col]));
  }
  return out;
}

// Trained means: exit 0, every logged training loss finite, and the mean of the last third of the
// logged losses below the mean of the first third.
void expect_trained(const FitResult& r) {
  ASSERT_EQ(r.status, 0) << r.log;
  ASSERT_TRUE(fs::exists(r.run_dir / "config.yaml")) << r.log;
  auto losses = train_losses(r.run_dir / "metrics.csv");
  ASSERT_GE(losses.size(), 6u) << "too few logged steps to judge training\n" << r.log;
  for (double l : losses) EXPECT_TRUE(std::isfinite(l)) << r.log;
  const size_t third = losses.size() / 3;
  double first = 0, last = 0;
  for (size_t i = 0; i < third; ++i) first += losses[i], last += losses[losses.size() - 1 - i];
  EXPECT_LT(last / third, first / third) << "the training loss did not decrease\n" << r.log;
}

#define REQUIRE_STROBE_BIN(var)                                                        \
  auto var##_opt = strobe_bin();                                                       \
  if (!var##_opt) GTEST_SKIP() << "STROBE_BIN is not a working strobe executable yet"; \
  const std::string var = *var##_opt

TEST(FitCpuConfigs, FaceDetectorWithGIoUTrains) {
  REQUIRE_STROBE_BIN(bin);
  expect_trained(fit(bin, "face_detector_giou.yaml", "face"));
}

TEST(FitCpuConfigs, ResNet18Trains) {
  REQUIRE_STROBE_BIN(bin);
  expect_trained(fit(bin, "resnet18_metrics.yaml", "resnet18"));
}

TEST(FitCpuConfigs, ViTTrains) {
  REQUIRE_STROBE_BIN(bin);
  expect_trained(fit(bin, "vit_l16.yaml", "vit"));
  expect_trained(fit(bin, "vit_long_seq.yaml", "vit_long"));
}

TEST(FitCpuConfigs, DecoderLMTrainsWithEveryCollate) {
  REQUIRE_STROBE_BIN(bin);
  // The config's attention (custom) takes every collate: the padded ones are right-padded, so the
  // model runs plain causal attention without a mask.
  for (const char* c : {"pad_to_max", "pad_to_longest", "pack"}) {
    expect_trained(fit(bin, "decoder_lm_varlen.yaml", std::string("lm_") + c,
                       std::string("--set data.collate=") + c + " --set trainer.max_steps=8"));
  }
}

// The llama CPU twin as it is (synthetic tokens: noise, nothing to learn, so only finite), then on
// the fortunes text (bytes: learnable), packed and padded, with the same losses.
TEST(FitCpuConfigs, LlamaTrainsPackedAndPadded) {
  REQUIRE_STROBE_BIN(bin);
  auto as_is = fit(bin, "llama_1b.yaml", "llama", "--set trainer.max_steps=6");
  ASSERT_EQ(as_is.status, 0) << as_is.log;
  for (double l : train_losses(as_is.run_dir / "metrics.csv")) EXPECT_TRUE(std::isfinite(l)) << as_is.log;
  std::vector<std::vector<double>> curves;
  for (const char* c : {"pack", "pad_to_max"}) {
    auto r = fit(bin, "llama_1b.yaml", std::string("llama_text_") + c,
                 std::string("--set 'data={name: text_file, max_seq_len: 64, batch_size: 16, num_workers: 1, collate: ") + c +
                     "}' --set trainer.max_steps=20");
    expect_trained(r);
    curves.push_back(train_losses(r.run_dir / "metrics.csv"));
  }
  ASSERT_EQ(curves[0].size(), curves[1].size());
  for (size_t i = 0; i < curves[0].size(); ++i) EXPECT_NEAR(curves[0][i], curves[1][i], 1e-4 * curves[0][i]) << "step " << i + 1;

  // bf16-master trains it; an exploding learning rate is caught by NaN capture and replayed exactly.
  auto bf16 = fit(bin, "llama_1b.yaml", "llama_bf16_master", "--set trainer.precision=bf16-master --set trainer.max_steps=6");
  ASSERT_EQ(bf16.status, 0) << bf16.log;
  for (double l : train_losses(bf16.run_dir / "metrics.csv")) EXPECT_TRUE(std::isfinite(l)) << bf16.log;
  auto nan = fit(bin, "llama_1b.yaml", "llama_nan", "--set 'callbacks=[{name: nan_capture}]' --set optimizer.lr=1e25");
  ASSERT_EQ(nan.status, 3) << nan.log;
  const fs::path report = nan.run_dir.parent_path() / "replay.json";
  const std::string cmd = bin + " replay " + (nan.run_dir / "nan").string() + " --report " + report.string() + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(report);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(text.find("\"exact\": true"), std::string::npos) << text;
  // The weights blew up; RMSNorm's fp32 square of the first layer's input overflows first, and is
  // named by the norm's own path (its parameter-free ops run under the block's ModuleScope).
  EXPECT_NE(text.find("\"op\": \"aten::pow\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"module\": \"layers.0.input_layernorm\""), std::string::npos) << text;
}

// precision bf16-master (what the GPU vit_l16 and decoder_lm_varlen configs use) through the CLI.
TEST(FitCpuConfigs, Bf16MasterTrainsTheTransformers) {
  REQUIRE_STROBE_BIN(bin);
  expect_trained(fit(bin, "vit_l16.yaml", "vit_bf16_master", "--set trainer.precision=bf16-master"));
  expect_trained(fit(bin, "decoder_lm_varlen.yaml", "lm_bf16_master",
                     "--set trainer.precision=bf16-master --set data.collate=pack --set trainer.max_steps=8"));
}

}  // namespace
