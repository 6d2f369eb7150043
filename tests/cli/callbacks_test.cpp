// Lightning's everyday callbacks through the real executable (docs/CONFIG.md, "callbacks"): the
// model summary at fit start, and their bad keys refused with exit 2.
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include <fmt/format.h>

#include "tests/cli/cli_test_util.h"
#include "tests/source_path.h"

using namespace strobe::testing;

namespace {

int occurrences(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// The table's module names (the second column) in order.
std::vector<std::string> summary_rows(const std::string& text) {
  std::vector<std::string> names;
  const std::regex row(R"(^\d+ +\| (\S+) +\|)");
  std::smatch m;
  for (const std::string& line : split_any(text, "\n"))
    if (std::regex_search(line, m, row)) names.push_back(m[1]);
  return names;
}

}  // namespace

// On by default: the table of the top-level modules and the totals, printed once and written to
// model_summary.txt; the counts are the MLP's by hand (64 -> 32 -> 16 -> 4 with biases), the size
// is at the parameters' dtype (fp32, then bf16 under bf16-master).
TEST(CliCallbacks, ModelSummaryIsPrintedAndWrittenAtFitStart) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("summary");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=1");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string file = slurp(dir + "/model_summary.txt");
  const int64_t fc0 = 64 * 32 + 32, fc1 = 32 * 16 + 16, head = 16 * 4 + 4, total = fc0 + fc1 + head;
  EXPECT_EQ(summary_rows(file), (std::vector<std::string>{"fc0", "fc1", "head"})) << file;
  EXPECT_NE(file.find("0 | fc0  | Linear | 2.1 K  | 2.1 K"), std::string::npos) << file;
  EXPECT_NE(file.find("2 | head | Linear | 68     | 68"), std::string::npos) << file;
  EXPECT_NE(file.find(fmt::format("Trainable params: {}\n", total)), std::string::npos) << file;
  EXPECT_NE(file.find("Non-trainable params: 0\n"), std::string::npos) << file;
  EXPECT_NE(file.find(fmt::format("Total params: {}\n", total)), std::string::npos) << file;
  EXPECT_NE(file.find(fmt::format("{:<10.3f}Total estimated model params size (MB)", total * 4 / 1e6)), std::string::npos) << file;
  EXPECT_NE(r.out.find(file), std::string::npos) << "stdout lacks the file's text:\n" << r.out;
  EXPECT_EQ(occurrences(r.out, "Total params"), 1) << r.out;

  const std::string bf16 = temp_dir("summary_bf16");
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + bf16 + " --set trainer.max_steps=1 --set trainer.precision=bf16-master");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(slurp(bf16 + "/model_summary.txt").find(fmt::format("{:<10.3f}Total estimated model params size (MB)", total * 2 / 1e6)),
            std::string::npos)
      << slurp(bf16 + "/model_summary.txt");
}

// max_depth as Lightning's: 1 the top level, n levels, -1 every level, 0 the totals alone; a listed
// model_summary replaces the default one; enable_model_summary: false writes and prints nothing.
TEST(CliCallbacks, ModelSummaryDepthAndSwitch) {
  const std::string vit = R"(name: vit_summary
seed: 0
trainer: {max_steps: 1, device: cpu, enable_progress_bar: false, num_sanity_val_steps: 0, limit_val_batches: 0}
model: {name: vit, img_size: 16, patch_size: 8, in_channels: 3, num_classes: 4, embed_dim: 16, depth: 2, num_heads: 2}
data: {name: synthetic_images, image_size: 16, channels: 3, num_classes: 4, num_samples: 8, num_val_samples: 4, batch_size: 4, num_workers: 0}
optimizer: {name: adamw, lr: 0.01}
)";
  const std::string cfg = write_config(vit);
  auto fit = [&](const std::string& tag, const std::string& sets) {
    const std::string dir = temp_dir(tag);
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=1 " + sets);
    EXPECT_EQ(r.code, 0) << tag << ": " << r.err;
    return std::make_pair(r, slurp(dir + "/model_summary.txt"));
  };
  auto totals = [](const std::string& text) { return text.substr(text.find("Trainable params")); };
  const auto [r1, depth1] = fit("depth1", "");
  const auto rows1 = summary_rows(depth1);
  EXPECT_EQ(rows1, (std::vector<std::string>{"patch_embed", "blocks", "norm", "head"})) << depth1;
  const auto [r2, depth2] = fit("depth2", "--set 'callbacks=[{name: model_summary, max_depth: 2}]'");
  const auto rows2 = summary_rows(depth2);
  EXPECT_NE(std::find(rows2.begin(), rows2.end(), "blocks.1"), rows2.end()) << depth2;
  for (const auto& name : rows2) EXPECT_LE(std::count(name.begin(), name.end(), '.'), 1) << name;
  const auto [r3, all] = fit("all", "--set 'callbacks=[{name: model_summary, max_depth: -1}]'");
  const auto rows3 = summary_rows(all);
  EXPECT_NE(std::find(rows3.begin(), rows3.end(), "blocks.1.fc2"), rows3.end()) << all;
  EXPECT_GT(rows3.size(), rows2.size());
  const auto [r4, none] = fit("depth0", "--set 'callbacks=[{name: model_summary, max_depth: 0}]'");
  EXPECT_TRUE(summary_rows(none).empty()) << none;
  EXPECT_EQ(none.find(" | "), std::string::npos) << none;
  EXPECT_EQ(occurrences(r4.out, "Total params"), 1) << r4.out;  // the listed one replaced the default
  for (const auto* text : {&depth2, &all, &none}) EXPECT_EQ(totals(*text), totals(depth1)) << *text;
  const auto [r5, off] = fit("off", "--set trainer.enable_model_summary=false");
  EXPECT_EQ(off, "");
  EXPECT_EQ(r5.out.find("Total params"), std::string::npos) << r5.out;
}

TEST(CliCallbacks, BadCallbackKeysExitTwoNamingTheKey) {
  const std::string cfg = write_config(tiny_yaml());
  struct Case {
    std::string callbacks, expect;
  };
  const std::vector<Case> cases = {
      {"[{name: model_summary, max_depth: -2}]", "callbacks[0].max_depth: "},
      {"[{name: model_summary, depth: 2}]", "callbacks[0].depth: unknown key"},
  };
  for (const auto& c : cases) {
    const std::string dir = temp_dir("badcb");
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run --set 'callbacks=" + c.callbacks + "'");
    EXPECT_EQ(r.code, 2) << c.callbacks << ": " << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.callbacks << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_FALSE(std::filesystem::exists(dir + "/run")) << c.callbacks;
  }
}
