// NaN forensics of a data-parallel run over NCCL on 2 GPUs, end to end as `strobe fit` and
// `strobe replay` run it: a regression whose sample 163 has an outlier target (unshuffled, the ranks
// take alternate indices: sample 163 is rank 1's, in step 11). Both ranks catch the loss spike (the
// loss all-reduced on the device), each writes its part; the replay on one GPU reads both parts and
// reproduces each rank's loss, and --bisect names rank 1 and sample 163. Skips (with the reason)
// without 2 visible GPUs; the parent never touches CUDA (its forked children could not initialize it).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "strobe/checkpoint/safetensors.h"
#include "strobe/config/config.h"
#include "runner/experiment_builder.h"
#include "runner/replay.h"
#include "tests/distributed/multiprocess.h"
#include "tests/test_dirs.h"

namespace strobe {
namespace replay_nccl {

namespace st = strobe::testing;
constexpr int kSkipCode = 77;

std::string yaml(const std::string& root, const std::string& data) {
  return fmt::format(R"(name: ddp_spike
seed: 5
trainer:
  max_epochs: 2
  max_steps: 20
  accumulate_grad_batches: 2
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
  device: auto
  dist_timeout: 120
  default_root_dir: {}
model: {{name: mlp, in_features: 8, hidden: [64], num_classes: 1}}
task: {{name: regression}}
data: {{name: tensor_file, path: {}, fields: {{image: x, target: y}}, val_fraction: 0.1, batch_size: 4, shuffle: false, num_workers: 0}}
optimizer: {{name: adamw, lr: 0.001}}
scheduler: {{name: none}}
callbacks: [{{name: nan_capture, keep_last: 2, spike: {{window: 8, warmup: 8}}}}]
)",
                     root, data);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, false);
}

TEST(GpuDDP, ASpikeOnTwoGpusReplaysEveryRankOnOneAndBisectNamesTheRank) {
  const std::string dir = st::empty_test_dir("strobe_gpu_replay_" + std::to_string(::getpid())).string();
  const std::string data = dir + "/reg.safetensors";
  auto writer = [&](int) {
    torch::manual_seed(0);
    auto x = torch::randn({200, 8});
    auto y = x.mm(torch::randn({8, 1}));
    y[163][0] = 1000.0;
    safetensors::write_file(data, {{"x", x}, {"y", y}});
    return 0;
  };
  ASSERT_EQ(st::run_ranks(1, writer, dir + "/writer", std::chrono::seconds(60), [] {})[0].exit_code, 0);
  auto body = [&](int rank) {
    torch::set_num_threads(1);
    if (torch::cuda::device_count() < 2) return kSkipCode;
    auto doc = config::Document::load_string(yaml(dir + "/root", data), "ddp_spike.yaml");
    auto run = build_run(doc, RunOptions{});
    const int rc = run->trainer->fit();
    std::ofstream(fmt::format("{}/rank{}.json", dir, rank)) << nlohmann::json{{"rc", rc}, {"run_dir", run->run_dir}}.dump();
    return rc;
  };
  auto rs = st::run_ranks(2, body, dir, std::chrono::seconds(240), [] {});
  for (const auto& r : rs)
    if (r.exit_code == kSkipCode) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
  ASSERT_EQ(rs[0].exit_code, 3) << st::describe(rs);
  ASSERT_EQ(rs[1].exit_code, 3) << st::describe(rs);
  const std::string run_dir = read_json(dir + "/rank0.json")["run_dir"];
  ASSERT_TRUE(std::filesystem::exists(run_dir + "/nan/step_11/capture.ckpt")) << st::describe(rs);
  ASSERT_TRUE(std::filesystem::exists(run_dir + "/nan/rank1/step_11/capture.ckpt")) << st::describe(rs);

  auto replay = [&](int) {
    torch::set_num_threads(1);
    std::ofstream(dir + "/replay.json") << capture::replay_capture(run_dir + "/nan", {}).dump(1);
    std::ofstream(dir + "/bisect.json") << capture::bisect_capture(run_dir + "/nan", {}).dump(1);
    return 0;
  };
  auto r = st::run_ranks(1, replay, dir + "/replay", std::chrono::seconds(240), [] {});
  ASSERT_EQ(r[0].exit_code, 0) << st::describe(r);
  auto rep = read_json(dir + "/replay.json"), bis = read_json(dir + "/bisect.json");
  std::cout << "[ replay nccl ] " << rep["ranks"].dump() << "\n";
  ASSERT_EQ(rep["ranks"].size(), 2u) << rep.dump(1);
  // Rank 0's part was captured on cuda:0, where it is replayed: the same bits. Rank 1's was captured
  // on cuda:1; the same kernels on the same GPU model give the same bits too.
  EXPECT_TRUE(rep["ranks"][0]["loss"]["bits_equal"].get<bool>()) << rep.dump(1);
  EXPECT_TRUE(rep["ranks"][1]["loss"]["bits_equal"].get<bool>()) << rep.dump(1);
  EXPECT_EQ(rep["culprit_ranks"], nlohmann::json::array({1})) << rep.dump(1);
  ASSERT_EQ(bis["samples"].size(), 1u) << bis.dump(1);
  EXPECT_EQ(bis["samples"][0]["rank"], 1) << bis.dump(1);
  EXPECT_EQ(bis["samples"][0]["dataset_index"], 163) << bis.dump(1);
}

}  // namespace replay_nccl
}  // namespace strobe
