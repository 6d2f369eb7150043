// Lightning's everyday callbacks through the real executable (docs/CONFIG.md, "callbacks"): the
// model summary at fit start, and their bad keys refused with exit 2.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/callback.h"
#include "strobe/core/model.h"
#include "strobe/core/module.h"
#include "strobe/core/throughput.h"
#include "strobe/core/trainer.h"
#include "strobe/core/trainer_view.h"
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
      {"[{name: throughput_monitor, every_n_steps: 0}]", "callbacks[0].every_n_steps: "},
      {"[{name: throughput_monitor, peak_tflops: -3}]", "callbacks[0].peak_tflops: "},
      {"[{name: device_stats_monitor, every_n_steps: 0}]", "callbacks[0].every_n_steps: "},
      {"[{name: device_stats_monitor, every: 5}]", "callbacks[0].every: unknown key"},
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

// --- throughput_monitor and device_stats_monitor -------------------------------------------------

namespace {

// Counts what each optimizer step processed, independently of the monitor: real tokens from the
// padding mask, samples from the tokens' rows, and the model's declared FLOPs.
class StepTally : public strobe::Callback {
 public:
  std::string name() const override { return "step_tally"; }
  void on_train_batch_start(strobe::TrainerView& t, strobe::Module& m, const strobe::Batch& b, int64_t) override {
    if (t.accumulated_batches() == 0) steps.emplace_back();
    auto& s = steps.back();
    s.real_tokens += b.at("padding_mask").sum().item<double>();
    s.padded_tokens += static_cast<double>(b.at("tokens").numel());
    s.samples += static_cast<double>(b.at("tokens").size(0));
    s.flops += dynamic_cast<strobe::Model&>(m.net()).training_flops(b);
  }
  struct Step {
    double real_tokens = 0, padded_tokens = 0, samples = 0, flops = 0;
  };
  std::vector<Step> steps;  // steps[i]: optimizer step i + 1
};

// metrics.csv's rows that hold `column`: step -> every non-empty cell of the row.
std::map<int64_t, std::map<std::string, std::string>> rows_with(const std::string& path, const std::string& column) {
  std::ifstream in(path);
  std::string header;
  std::getline(in, header);
  const auto cols = split_any(header, ",");
  std::map<int64_t, std::map<std::string, std::string>> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::stringstream ls(line + ",");
    for (std::string c; std::getline(ls, c, ',');) cells.push_back(c);
    std::map<std::string, std::string> row;
    for (size_t i = 2; i < cells.size() && i < cols.size(); ++i)
      if (!cells[i].empty()) row[cols[i]] = cells[i];
    if (row.count(column)) rows[std::stoll(cells[0])] = row;
  }
  return rows;
}

std::string padded_lm_yaml(const std::string& callbacks) {
  return R"(name: throughput
seed: 3
trainer: {max_steps: 12, log_every_n_steps: 4, device: cpu, enable_progress_bar: false, enable_model_summary: false,
          num_sanity_val_steps: 0, val_check_interval: 12, limit_val_batches: 1, accumulate_grad_batches: 2}
model: {name: decoder_lm, vocab_size: 64, max_seq_len: 32, embed_dim: 32, depth: 2, num_heads: 2}
data: {name: synthetic_tokens, vocab_size: 64, max_seq_len: 32, num_samples: 256, num_val_samples: 8, batch_size: 4,
       collate: pad_to_max, num_workers: 0}
optimizer: {name: adamw, lr: 1.0e-3}
callbacks: )" + callbacks + "\n";
}

}  // namespace

// Every 4 steps (trainer.log_every_n_steps) the window's rates, whose products with its time give
// back what the steps processed: real tokens (not the padded positions), samples, the model's FLOPs
// (and, with a stated peak, the utilisation). Validation at step 6 closes a window early: its steps
// are logged at step 6 and the next window opens after it.
TEST(CliCallbacks, ThroughputMonitorCountsRealTokensSamplesAndFlopsPerWindow) {
  const std::string dir = temp_dir("throughput");
  auto tally = std::make_shared<StepTally>();
  auto run = make_run(padded_lm_yaml("[{name: throughput_monitor, peak_tflops: 0.5}, {name: device_stats_monitor, every_n_steps: 3}]"),
                      {}, dir, std::nullopt, {tally});
  ASSERT_EQ(run->trainer->fit(), 0);
  ASSERT_EQ(tally->steps.size(), 12u);
  const auto rows = rows_with(dir + "/metrics.csv", "throughput/samples_per_s");
  std::vector<int64_t> logged;
  for (const auto& kv : rows) logged.push_back(kv.first);
  EXPECT_EQ(logged, (std::vector<int64_t>{4, 6, 8, 12})) << "windows: 1-4, 5-6 (closed by validation), 7-8, 9-12";
  const std::map<int64_t, int64_t> first_step = {{4, 1}, {6, 5}, {8, 7}, {12, 9}};
  for (const auto& [step, row] : rows) {
    const int64_t from = first_step.at(step);
    StepTally::Step sum;
    for (int64_t s = from; s <= step; ++s) {
      const auto& x = tally->steps[static_cast<size_t>(s - 1)];
      sum.real_tokens += x.real_tokens, sum.padded_tokens += x.padded_tokens, sum.samples += x.samples, sum.flops += x.flops;
    }
    const double secs = std::stod(row.at("throughput/step_ms")) * static_cast<double>(step - from + 1) / 1e3;
    ASSERT_LT(sum.real_tokens, sum.padded_tokens) << "the data must pad for this test to tell the two apart";
    EXPECT_NEAR(std::stod(row.at("throughput/tokens_per_s")) * secs, sum.real_tokens, 1e-4 * sum.real_tokens) << step;
    EXPECT_NEAR(std::stod(row.at("throughput/samples_per_s")) * secs, sum.samples, 1e-4 * sum.samples) << step;
    const double tflops = std::stod(row.at("throughput/device_tflop_per_s"));
    EXPECT_GT(sum.flops, 0);
    EXPECT_NEAR(tflops * 1e12 * secs, sum.flops, 1e-4 * sum.flops) << step;
    EXPECT_NEAR(std::stod(row.at("throughput/mfu")), tflops / 0.5, 1e-6 * tflops) << step;
  }
  // device_stats_monitor: step 1 and every 3rd step; on the CPU the host's resident memory alone.
  const auto stats = rows_with(dir + "/metrics.csv", "device_stats/host_rss_gib");
  std::vector<int64_t> stat_steps;
  for (const auto& kv : stats) {
    stat_steps.push_back(kv.first);
    const double rss = std::stod(kv.second.at("device_stats/host_rss_gib"));
    EXPECT_GT(rss, 0.05) << "a libtorch process holds more than 50 MiB";
    EXPECT_LT(rss, 64.0);
    EXPECT_EQ(kv.second.count("device_stats/allocated_gib") ? kv.second.at("device_stats/allocated_gib") : "", "");
  }
  EXPECT_EQ(stat_steps, (std::vector<int64_t>{1, 3, 6, 9, 12}));
}

// The dense peaks by device name and dtype: each part its own row (the PCIe and NVL H100s are not
// the SXM part), dense figures (not the datasheets' sparse ones), no row for what is not listed.
TEST(CliCallbacks, DensePeakTableMatchesDevicesByName) {
  struct Case {
    std::string name, dtype;
    double tflops;  // 0: none
  };
  const std::vector<Case> cases = {
      {"NVIDIA H100 80GB HBM3", "bf16", 989.4}, {"NVIDIA H100 PCIe", "bf16", 756},  {"NVIDIA H100 NVL", "bf16", 835.5},
      {"NVIDIA H200", "bf16", 989.4},           {"NVIDIA H200 NVL", "fp16", 835.5}, {"NVIDIA GH200 480GB", "fp8", 1978.9},
      {"NVIDIA H100 80GB HBM3", "fp32", 67},    {"NVIDIA H100 80GB HBM3", "tf32", 494.7},
      {"NVIDIA A100-SXM4-80GB", "bf16", 312},   {"NVIDIA A100 80GB PCIe", "tf32", 156},
      {"NVIDIA L40S", "bf16", 362.05},          {"NVIDIA L40", "bf16", 181.05},     {"NVIDIA L4", "bf16", 121},
      {"NVIDIA A10", "bf16", 125},              {"NVIDIA A10G", "bf16", 0},         {"NVIDIA A100-SXM4-40GB", "fp8", 0},
      {"Tesla V100-SXM2-16GB", "bf16", 0},      {"Tesla V100-SXM2-16GB", "fp16", 125}, {"Tesla T4", "fp16", 0},
      {"cpu", "fp32", 0}};
  for (const auto& c : cases) {
    const auto p = strobe::dense_peak(c.name, c.dtype);
    if (c.tflops == 0) {
      EXPECT_FALSE(p) << c.name << " " << c.dtype << ": " << (p ? p->device : "");
    } else {
      ASSERT_TRUE(p) << c.name << " " << c.dtype;
      EXPECT_DOUBLE_EQ(p->flops, c.tflops * 1e12) << c.name << " " << c.dtype << " (row " << p->device << ")";
    }
  }
  EXPECT_EQ(strobe::matmul_dtype(strobe::Precision::kBf16Master), "bf16");
  EXPECT_EQ(strobe::matmul_dtype(strobe::Precision::k16Mixed), "fp16");
}

// --- on_exception_checkpoint ----------------------------------------------------------------------

namespace {

std::map<std::string, torch::Tensor> ckpt_tensors(const std::string& path) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [k, v] : strobe::checkpoint::load_checkpoint_file(path).tensors)
    if (k.rfind("model/", 0) == 0 || k.rfind("rng/", 0) == 0) out[k] = v;
  return out;
}

void expect_same_tensors(const std::string& a, const std::string& b, const std::string& what) {
  const auto ta = ckpt_tensors(a), tb = ckpt_tensors(b);
  ASSERT_EQ(ta.size(), tb.size()) << what;
  for (const auto& [k, v] : ta) {
    ASSERT_TRUE(tb.count(k)) << what << ": " << k;
    EXPECT_TRUE(torch::equal(v, tb.at(k))) << what << ": " << k << " differs";
  }
}

}  // namespace

// An exception inside step 5 (after its forward and backward: dropout masks drawn, BatchNorm
// statistics moved, no update) leaves <run>/checkpoints/on_exception.ckpt holding step 4 exactly as
// an uninterrupted run's step-4 checkpoint holds it (weights, buffers, generators), and resuming it
// ends where the uninterrupted run ends, bit for bit. A model with dropout and one with BatchNorm.
TEST(CliCallbacks, OnExceptionCheckpointHoldsTheLastCompletedStepAndResumesExactly) {
  const std::string mlp = tiny_yaml("  max_steps: 8\n");
  const std::string resnet = R"(name: bn
seed: 4
trainer: {max_steps: 8, log_every_n_steps: 1, num_sanity_val_steps: 0, enable_progress_bar: false, device: cpu}
model: {name: resnet, depth: 18, width: 4, stem: cifar, num_classes: 4, in_channels: 1}
data: {name: synthetic_images, image_size: 8, channels: 1, num_classes: 4, num_samples: 96, num_val_samples: 16, batch_size: 8, num_workers: 2}
optimizer: {name: sgd, lr: 0.1, momentum: 0.9}
)";
  for (const auto& [tag, yaml] : std::vector<std::pair<std::string, std::string>>{{"dropout", mlp}, {"batchnorm", resnet}}) {
    const std::string cfg = write_config(yaml);
    const std::string root = temp_dir("onexc-" + tag), full = root + "/full", failed = root + "/failed";
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + full +
                        " --set 'callbacks=[{name: model_checkpoint, every_n_steps: 1, save_top_k: -1}]'");
    ASSERT_EQ(r.code, 0) << tag << ": " << r.err;
    r = shell_cmd("STROBE_FAULT_AT=throw:after_backward@5 ",
                  "fit -c " + cfg + " --run-dir " + failed + " --set 'callbacks=[{name: on_exception_checkpoint}]'");
    const std::string saved = failed + "/checkpoints/on_exception.ckpt";
    EXPECT_EQ(r.code, 1) << tag << ": " << r.err;
    EXPECT_EQ(r.err, "strobe: training stopped by an error in step 5; saved " + saved +
                         " at step 4 (the failed step's start); resume with --ckpt " + saved +
                         "\nstrobe: error: fault point after_backward at step 5 (STROBE_FAULT_AT)\n")
        << tag;
    ASSERT_TRUE(std::filesystem::exists(saved)) << tag;
    EXPECT_EQ(nlohmann::json::parse(strobe::checkpoint::load_checkpoint_file(saved).blob("meta"))["global_step"], 4) << tag;
    expect_same_tensors(saved, full + "/checkpoints/step=4.ckpt", tag + ": on_exception.ckpt against step 4's");
    r = strobe_cmd("fit -c " + cfg + " --ckpt " + saved);
    ASSERT_EQ(r.code, 0) << tag << ": " << r.err;
    expect_same_tensors(failed + "/checkpoints/last.ckpt", full + "/checkpoints/last.ckpt", tag + ": the resumed run's end");
    const auto a = read_csv(full + "/metrics.csv", "train/loss"), b = read_csv(failed + "/metrics.csv", "train/loss");
    EXPECT_EQ(a, b) << tag << ": train/loss rows";
  }
}

// A save that cannot be written says so in one line and the error that stopped training is still
// the one reported (and the exit status its own).
TEST(CliCallbacks, OnExceptionCheckpointNeverHidesTheError) {
  const std::string cfg = write_config(tiny_yaml("  max_steps: 8\n") +
                                       "callbacks:\n  - name: on_exception_checkpoint\n    filename: crash\n");
  const std::string dir = temp_dir("onexc-blocked");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/checkpoints") << "a file where the directory would go\n";
  auto r = shell_cmd("STROBE_FAULT_AT=throw:after_backward@3 ", "fit -c " + cfg + " --run-dir " + dir);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(count_lines(r.err), 2) << r.err;
  EXPECT_EQ(r.err.rfind("strobe: on_exception_checkpoint: could not save " + dir + "/checkpoints/crash.ckpt: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("\nstrobe: error: fault point after_backward at step 3 (STROBE_FAULT_AT)\n"), std::string::npos) << r.err;
}
