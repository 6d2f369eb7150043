// trainer.profiler and `strobe bench step` on CUDA: the trace holds the GPU kernels of exactly the
// requested steps (ProfilerStep#N on the CPU and GPU timelines), and the step suite times CUDA steps
// with events (JSON names the CUDA device; statistics hold together).
#include <gtest/gtest.h>

#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tests/cli/cli_test_util.h"
#include "tests/source_path.h"

using namespace strobe::testing;
namespace fs = std::filesystem;

TEST(ProfilerCuda, TraceHoldsTheKernelsOfTheRequestedSteps) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: CUDA profiler test skipped";
  std::string y = tiny_yaml();
  y.replace(y.find("device: cpu"), 11, "device: cuda");
  const std::string cfg = write_config(y), dir = temp_dir("prof-cuda");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=6 --set 'trainer.profiler={steps: [2, 3]}'");
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir + "/profiler")) files.push_back(e.path().string());
  ASSERT_EQ(files.size(), 1u);
  const auto j = nlohmann::json::parse(slurp(files[0]));
  std::set<std::string> cpu_steps, gpu_steps;
  int64_t kernels = 0, aten = 0;
  for (const auto& e : j.at("traceEvents")) {
    const std::string name = e.value("name", ""), cat = e.value("cat", "");
    if (name.rfind("ProfilerStep#", 0) == 0) (cat == "gpu_user_annotation" ? gpu_steps : cpu_steps).insert(name);
    kernels += cat == "kernel";
    aten += cat == "cpu_op" && name.rfind("aten::", 0) == 0;
  }
  EXPECT_EQ(cpu_steps, (std::set<std::string>{"ProfilerStep#2", "ProfilerStep#3"}));
  EXPECT_EQ(gpu_steps, (std::set<std::string>{"ProfilerStep#2", "ProfilerStep#3"}));
  EXPECT_GT(kernels, 10);
  EXPECT_GT(aten, 20);
}

TEST(BenchCuda, StepSuiteTimesCudaStepsWithEvents) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: CUDA bench test skipped";
  const std::string out = temp_dir("bench-cuda") + "/b.json";
  auto r = strobe_cmd(std::string("bench step --config ") + strobe::testing::source_path("configs/cpu/vit_l16.yaml") +
                      " --set trainer.device=cuda --set model.attention=sdpa"  // head_dim 16: not our kernel's
                      " --warmup 3 --steps 6 --json " + out);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(slurp(out));
  EXPECT_EQ(j.at("device").get<std::string>().rfind("cuda: ", 0), 0u) << j.at("device");
  const auto& w = j.at("suites").at("step").at("workloads").at(0);
  EXPECT_EQ(w.at("device"), "cuda:0");
  EXPECT_EQ(w.at("steps").get<int64_t>(), 6);
  const auto& s = w.at("ms");
  EXPECT_GT(s.at("min").get<double>(), 0.0);
  EXPECT_LE(s.at("min").get<double>(), s.at("median").get<double>());
  EXPECT_LE(s.at("median").get<double>(), s.at("max").get<double>());
}

// --memory-limit-gib caps the run's GPU as a smaller GPU would: the same run that trains uncapped
// runs out of memory under half its own peak allocation (one line, exit 1), and a cap past the
// GPU's memory is refused (exit 2). The JSON says what the GPU had to hold.
TEST(BenchCuda, MemoryLimitCapsTheRunAsASmallerGpuWould) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: CUDA bench test skipped";
  const std::string dir = temp_dir("bench-cap");
  const std::string run = std::string("bench step --config ") + strobe::testing::source_path("configs/cpu/vit_l16.yaml") +
                          " --set trainer.device=cuda --set model.attention=sdpa --set data.batch_size=64 --warmup 1 --steps 2";
  auto free = strobe_cmd(run + " --json " + dir + "/free.json");
  ASSERT_EQ(free.code, 0) << free.err;
  const auto w = nlohmann::json::parse(slurp(dir + "/free.json")).at("suites").at("step").at("workloads").at(0);
  const double reserved = w.at("peak_reserved_gib").get<double>();
  EXPECT_GE(reserved, w.at("peak_memory_gib").get<double>());
  // Setup's peak (before the first batch): the model's device copies at least, the run's peak at most.
  EXPECT_GT(w.at("setup_peak_memory_gib").get<double>(), 0.0);
  EXPECT_LE(w.at("setup_peak_memory_gib").get<double>(), w.at("peak_memory_gib").get<double>());
  EXPECT_GE(w.at("device_used_gib").get<double>(), w.at("reserved_gib").get<double>());
  EXPECT_FALSE(w.contains("memory_limit_gib"));

  const std::string half = fmt::format("{:.4f}", w.at("peak_memory_gib").get<double>() / 2);
  auto capped = strobe_cmd(run + " --memory-limit-gib " + half);
  EXPECT_EQ(capped.code, 1) << capped.err;
  EXPECT_NE(capped.err.find("strobe bench: out of memory under --memory-limit-gib " + fmt::format("{:g}", std::stod(half)) +
                            " (CUDA out of memory"),
            std::string::npos)
      << capped.err;
  EXPECT_EQ(capped.err.find("Exception raised from"), std::string::npos) << capped.err;

  auto roomy = strobe_cmd(run + " --memory-limit-gib " + fmt::format("{:.4f}", reserved * 2 + 0.5) + " --json " + dir + "/cap.json");
  ASSERT_EQ(roomy.code, 0) << roomy.err;
  const auto c = nlohmann::json::parse(slurp(dir + "/cap.json")).at("suites").at("step").at("workloads").at(0);
  EXPECT_NEAR(c.at("memory_limit_gib").get<double>(), reserved * 2 + 0.5, 1e-3);

  auto too_much = strobe_cmd(run + " --memory-limit-gib 100000");
  EXPECT_EQ(too_much.code, 2) << too_much.err;
  EXPECT_NE(too_much.err.find("strobe bench: --memory-limit-gib 100000 is more than cuda:0 has"), std::string::npos) << too_much.err;
}
