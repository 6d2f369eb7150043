// `strobe bench`: the step suite through the real trainer on a CPU twin config (JSON shape, step
// counts, statistics that hold together), CUDA-only suites skipped on the CPU, bad usage refused.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "tests/cli/cli_test_util.h"
#include "tests/source_path.h"

using namespace strobe::testing;
using nlohmann::json;

namespace {

std::string src(const std::string& rel) {
  return strobe::testing::source_path(rel);
}

void expect_stats(const json& s, const std::string& what, int64_t n) {
  EXPECT_EQ(s.at("n").get<int64_t>(), n) << what;
  const double med = s.at("median"), mn = s.at("min"), mx = s.at("max"), p10 = s.at("p10"), p90 = s.at("p90");
  EXPECT_LE(mn, p10) << what;
  EXPECT_LE(p10, med) << what;
  EXPECT_LE(med, p90) << what;
  EXPECT_LE(p90, mx) << what;
}

}  // namespace

TEST(BenchCli, StepSuiteOnACpuTwinConfig) {
  const std::string out = temp_dir("bench") + "/bench.json";
  auto r = strobe_cmd("bench step --config " + src("configs/cpu/vit_l16.yaml") +
                      " --warmup 2 --steps 5 --set trainer.device=cpu --json " + out);
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(slurp(out));
  EXPECT_EQ(j.at("device"), torch::cuda::is_available() ? j.at("device").get<std::string>() : "cpu");
  const json& s = j.at("suites").at("step");
  EXPECT_EQ(s.at("status"), "ok");
  ASSERT_EQ(s.at("workloads").size(), 1u);
  const json& w = s.at("workloads")[0];
  EXPECT_EQ(w.at("name"), "vit_l16");
  EXPECT_EQ(w.at("steps").get<int64_t>(), 5);
  EXPECT_EQ(w.at("warmup_steps").get<int64_t>(), 2);
  EXPECT_EQ(w.at("batch_size").get<int64_t>(), 32);
  expect_stats(w.at("ms"), "step", 5);
  expect_stats(w.at("input_wait_ms"), "input wait", 5);
  expect_stats(w.at("compute_ms"), "compute", 5);
  EXPECT_GT(w.at("ms").at("min").get<double>(), 0.0);
  EXPECT_GE(w.at("input_wait_ms").at("min").get<double>(), 0.0);
  const auto steps = w.at("step_ms_all").get<std::vector<double>>();
  const auto waits = w.at("input_wait_ms_all").get<std::vector<double>>();
  ASSERT_EQ(steps.size(), 5u);
  ASSERT_EQ(waits.size(), 5u);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_GT(steps[i], 0.0);
    EXPECT_LE(waits[i], steps[i]) << "step " << i;  // the wait lies inside the step's interval
  }
  EXPECT_GT(w.at("samples_per_s").get<double>(), 0.0);
  // One process: rank 0 of 1; the memory figures are CUDA's.
  EXPECT_EQ(w.at("world_size").get<int64_t>(), 1);
  EXPECT_EQ(w.at("rank").get<int64_t>(), 0);
  if (!torch::cuda::is_available())
    EXPECT_FALSE(w.contains("state_memory_gib") || w.contains("peak_memory_gib") || w.contains("setup_peak_memory_gib"));
  // The table names the workload with its median.
  EXPECT_NE(r.out.find("vit_l16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(fmt::format("{:.3f}", w.at("ms").at("median").get<double>())), std::string::npos) << r.out;
  // The JSON was written atomically: no temp file is left beside it.
  std::vector<std::string> beside;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(out).parent_path()))
    beside.push_back(e.path().filename().string());
  EXPECT_EQ(beside, std::vector<std::string>{"bench.json"});
  // No run directory, checkpoint or log is written by a benchmark.
  EXPECT_FALSE(std::filesystem::exists("runs/vit_l16_cpu"));
}

// A token workload reports tokens/s and the model's training FLOPs per step (PaLM's 6 N + 12 L d S per
// token, N the weights that multiply: not the embedding lookup, but its tied head): the llama CPU
// twin on full 64-token sequences, batch 16.
TEST(BenchCli, StepSuiteCountsTokensAndModelFlopsOfADecoder) {
  const std::string out = temp_dir("bench-llama") + "/bench.json";
  auto r = strobe_cmd("bench step --config " + src("configs/cpu/llama_1b.yaml") +
                      " --warmup 1 --steps 3 --set trainer.device=cpu --set data.fixed_length=true"
                      " --set data.collate=pad_to_max --json " + out);
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(slurp(out));
  const json& w = j.at("suites").at("step").at("workloads")[0];
  EXPECT_EQ(w.at("tokens_per_step").get<double>(), 16 * 64);
  EXPECT_NEAR(w.at("tokens_per_s").get<double>(), 1024 * 1e3 / w.at("ms").at("mean").get<double>(), 1e-6);
  // N = 2 layers x (q, o 64x64; k, v 64x32 (2 KV heads); 3 x 64x256 MLP) + the tied head 512x64 = 155648.
  const double per_token = 6.0 * 155648 + 12.0 * 2 * 64 * 64;
  EXPECT_NEAR(w.at("model_tflop_per_step").get<double>(), per_token * 1024 / 1e12, 1e-12);
  EXPECT_FALSE(w.contains("mfu")) << "no peak FLOP/s is known for a CPU";
}

TEST(BenchCli, CudaSuitesAreSkippedOnTheCpu) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a CUDA device is visible: the suite runs instead";
  const std::string out = temp_dir("bench") + "/skip.json";
  auto r = strobe_cmd("bench giou attention optimizer metrics nan_capture --json " + out);
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(slurp(out));
  for (const char* s : {"giou", "attention", "optimizer", "metrics", "nan_capture"}) {
    EXPECT_EQ(j.at("suites").at(s).at("status"), "skipped") << s;
    EXPECT_NE(j.at("suites").at(s).at("reason").get<std::string>().find("needs a CUDA device"), std::string::npos);
    EXPECT_NE(r.err.find(std::string("strobe bench: ") + s + " skipped: needs a CUDA device"), std::string::npos) << r.err;
    EXPECT_NE(r.out.find(std::string(s) + " "), std::string::npos) << r.out;
  }
}

TEST(BenchCli, BadUsageExitsTwoWithOneLine) {
  const std::string out = temp_dir("bench-bad") + "/never.json";
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"bench stepz", "strobe bench: unknown suite 'stepz' (suites: step, giou, attention, optimizer, metrics, nan_capture)"},
      {"bench step --json /nonexistent/dir/out.json", "strobe bench: --json /nonexistent/dir/out.json: the directory /nonexistent/dir does not exist"},
      {"bench giou --config x.yaml", "--config applies to the step suite only"},
      {"bench step --config /nonexistent.yaml", "/nonexistent.yaml: cannot open config file"},
      {"bench step --config " + src("configs/cpu/vit_l16.yaml") + " --set model.depthh=2", "model.depthh: unknown key"},
      {"bench step --steps 0", "--steps: expected a number above 0, got '0'"},
      {"bench step --warmup -1", "--warmup: expected a number of 0 or more, got '-1'"},
      {"bench step --memory-limit-gib nan", "--memory-limit-gib: expected a number above 0, got 'nan'"},
      {"bench step --workload vit --json " + out, "--workload: unknown workload 'vit' (workloads: vit_l16, face_detector_giou, resnet50, lm_pack"},
      {"bench giou --workload vit_l16", "--workload applies to the step suite only"},
      {"bench giou --memory-limit-gib 10", "--memory-limit-gib applies to the step suite only"},
      {"bench step --memory-limit-gib 0", "--memory-limit-gib: expected a number above 0, got '0'"},
      // No GPU: refused before anything runs; a GPU machine running a CPU config: refused at the
      // device the run trains on.
      torch::cuda::is_available()
          ? Case{"bench step --memory-limit-gib 10 --set trainer.device=cpu --config " + src("configs/cpu/vit_l16.yaml"),
                 "--memory-limit-gib caps a GPU's memory, and this run trains on cpu"}
          : Case{"bench step --memory-limit-gib 10 --json " + out, "--memory-limit-gib caps a GPU's memory, and no CUDA device is visible"},
  };
  for (const auto& c : cases) {
    auto r = strobe_cmd(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_LE(r.err.size(), 200u) << r.err;  // never CLI11's 370-character range
    EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
  }
  EXPECT_FALSE(std::filesystem::exists(out));  // refused before anything ran or was written
  auto h = strobe_cmd("--help");
  EXPECT_EQ(h.code, 0);
  EXPECT_NE(h.out.find("bench"), std::string::npos) << h.out;
}

namespace strobe::testing {
namespace {

// Run away from the repository (and its source tree), a seed workload's config cannot be found: the
// one line says where they are looked for and what to do instead.
TEST(BenchCli, SeedWorkloadsAwayFromTheRepositorySayWhereTheyAreLookedFor) {
  const std::string dir = temp_dir("bench-elsewhere");
  const std::string strobe = std::filesystem::absolute(bin()).string();
  const std::string cmd = "cd " + dir + " && STROBE_SOURCE_DIR=" + dir + " " + strobe + " bench step --workload resnet50 > " + dir +
                          "/out 2> " + dir + "/err";
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 2);
  const std::string err = slurp(dir + "/err");
  EXPECT_NE(err.find("strobe bench: workload resnet50: its config configs/cpu/resnet50_nan.yaml is one of the repository's "
                     "configs/ and is found from the repository root"),
            std::string::npos)
      << err;
  EXPECT_EQ(count_lines(err), 1) << err;
}

}  // namespace
}  // namespace strobe::testing

namespace strobe::testing {
namespace {

// -c from a pipe with --json: the output check reads no byte of the pipe (the suite reads it once).
TEST(BenchCli, AConfigFromAPipeIsReadOnceByTheSuite) {
  const std::string dir = temp_dir("bench-pipe");
  const std::string fifo = dir + "/cfg";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto r = shell_cmd("(cat " + src("configs/cpu/vit_l16.yaml") + " > " + fifo + " &); timeout 120 ",
                     "bench step -c " + fifo + " --steps 1 --warmup 0 --set model.depth=1 --set data.batch_size=2 --json " + dir +
                         "/r.json");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(slurp(dir + "/r.json")).at("suites").at("step").at("workloads").size(), 1u);
}

}  // namespace
}  // namespace strobe::testing
