// trainer.profiler / `strobe fit --profile`: a Chrome trace of exactly the requested training
// steps (ProfilerStep#N ranges holding aten:: ops), nothing outside them, nothing without the key,
// and bad keys refused with one line.
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "tests/cli/cli_test_util.h"

using namespace strobe::testing;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path().filename().string());
  return out;
}

struct Trace {
  std::map<int64_t, std::pair<double, double>> steps;  // N -> [ts, ts + dur] of ProfilerStep#N
  std::vector<std::pair<std::string, double>> aten;    // aten:: op name, ts (CPU ops)
};

Trace read_trace(const std::string& path) {
  const auto j = nlohmann::json::parse(slurp(path));
  Trace t;
  for (const auto& e : j.at("traceEvents")) {
    if (!e.contains("name") || !e.contains("ts") || e.value("ph", "") != "X") continue;
    const std::string name = e["name"];
    const double ts = e["ts"].get<double>(), dur = e.value("dur", 0.0);
    if (name.rfind("ProfilerStep#", 0) == 0 && e.value("cat", "") == "user_annotation") {  // not the GPU copy
      const int64_t n = std::stoll(name.substr(13));
      EXPECT_EQ(t.steps.count(n), 0u) << "ProfilerStep#" << n << " twice";
      t.steps[n] = {ts, ts + dur};
    } else if (name.rfind("aten::", 0) == 0 && e.value("cat", "") == "cpu_op") {
      t.aten.emplace_back(name, ts);
    }
  }
  return t;
}

// The only trace file in `dir` (no temp files beside it).
std::string the_trace(const std::string& dir) {
  auto names = files_in(dir);
  EXPECT_EQ(names.size(), 1u) << "files in " << dir << ": " << names.size();
  if (names.empty()) return "";
  EXPECT_NE(names[0].find(".pt.trace.json"), std::string::npos) << names[0];
  EXPECT_NE(names[0][0], '.') << names[0];
  return dir + "/" + names[0];
}

void expect_exactly_steps(const Trace& t, int64_t first, int64_t last) {
  std::vector<int64_t> got, want;
  for (const auto& kv : t.steps) got.push_back(kv.first);
  for (int64_t n = first; n <= last; ++n) want.push_back(n);
  EXPECT_EQ(got, want);
  ASSERT_FALSE(t.aten.empty());
  std::set<std::string> ops;
  for (const auto& [name, ts] : t.aten) {
    ops.insert(name);
    bool inside = false;
    for (const auto& kv : t.steps) inside |= ts >= kv.second.first && ts <= kv.second.second;
    EXPECT_TRUE(inside) << name << " at " << ts << " is outside every ProfilerStep range";
  }
  // Forward, backward and the optimizer of a step are all in the trace.
  EXPECT_TRUE(ops.count("aten::addmm") || ops.count("aten::linear")) << "no linear layer op";
  EXPECT_TRUE(ops.count("aten::mm")) << "no backward matmul";
  for (const auto& kv : t.steps) {
    int64_t n = 0;
    for (const auto& [name, ts] : t.aten) n += ts >= kv.second.first && ts <= kv.second.second;
    EXPECT_GT(n, 10) << "ProfilerStep#" << kv.first << " holds only " << n << " aten ops";
  }
}

}  // namespace

TEST(Profiler, TraceHoldsExactlyTheRequestedSteps) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("prof");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=9 --set 'trainer.profiler={steps: [3, 5]}'");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string trace = the_trace(dir + "/profiler");
  ASSERT_FALSE(trace.empty());
  expect_exactly_steps(read_trace(trace), 3, 5);
  EXPECT_NE(r.err.find("profiler trace of steps 3-5"), std::string::npos) << r.err;
  // The resolved config records the key with its defaults.
  const std::string resolved = slurp(dir + "/config.yaml");
  EXPECT_NE(resolved.find("record_shapes: false"), std::string::npos) << resolved;
}

TEST(Profiler, ProfileFlagUsesTheDefaultStepsAndAPathKeyMovesTheTrace) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("prof-flag");
  // --profile: steps 20..25; with accumulation a step spans two batches.
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir +
                      " --profile --set trainer.max_epochs=5 --set trainer.max_steps=27 --set trainer.accumulate_grad_batches=2");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string trace = the_trace(dir + "/profiler");
  ASSERT_FALSE(trace.empty());
  expect_exactly_steps(read_trace(trace), 20, 25);

  const std::string dir2 = temp_dir("prof-path"), elsewhere = temp_dir("prof-elsewhere") + "/traces";
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir2 + " --set trainer.max_steps=3 --set 'trainer.profiler={steps: [1, 1], path: " +
                 elsewhere + "}'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(files_in(dir2 + "/profiler").empty());
  const std::string t2 = the_trace(elsewhere);
  ASSERT_FALSE(t2.empty());
  expect_exactly_steps(read_trace(t2), 1, 1);
}

TEST(Profiler, RunEndingEarlyKeepsWhatWasProfiledAndNoKeyWritesNothing) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("prof-early");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=4 --set 'trainer.profiler={steps: [3, 8]}'");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string trace = the_trace(dir + "/profiler");
  ASSERT_FALSE(trace.empty());
  expect_exactly_steps(read_trace(trace), 3, 4);
  EXPECT_NE(r.err.find("training ended at step 4, before step 8"), std::string::npos) << r.err;

  const std::string plain = temp_dir("prof-none");
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + plain + " --set trainer.max_steps=4");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(plain + "/profiler"));
  EXPECT_EQ(r.err.find("profiler"), std::string::npos) << r.err;
}

TEST(Profiler, BadKeysExitTwoWithOneLine) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("prof-bad");
  struct Case {
    std::string set, expect;
  } cases[] = {
      {"'trainer.profiler={steps: [5, 3]}'", "trainer.profiler.steps: expected two step numbers [first, last] with 1 <= first <= last"},
      {"'trainer.profiler={steps: [-1, 3]}'", "trainer.profiler.steps: expected two step numbers"},
      {"'trainer.profiler={steps: [0, 3]}'", "trainer.profiler.steps: expected two step numbers"},
      {"'trainer.profiler={steps: [4]}'", "got 1 value(s)"},
      {"'trainer.profiler={steps: [1, x]}'", "trainer.profiler.steps: expected a list of integers"},
      {"'trainer.profiler={step: [1, 2]}'", "trainer.profiler.step: unknown key; did you mean 'steps'?"},
      {"trainer.profiler=7", "trainer.profiler: expected true or false"},
      {"'trainer.profiler={path: /proc/nope}'", "trainer.profiler.path: cannot create the trace directory"},
  };
  for (const auto& c : cases) {
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/x --set trainer.max_steps=2 --set " + c.set);
    EXPECT_EQ(r.code, 2) << c.set << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.set << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
}
