// A checkpoint written by an earlier Strobe (tests/fixtures/resume, README there) resumes with this
// code to the losses, validation metrics and final weights of an uninterrupted run, bit for bit:
// the on-disk keys and blob layouts a checkpoint holds stay readable as they were. The fixture was
// taken mid-way through gradient accumulation with NaN capture on (which crashed such a resume).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/cli/cli_test_util.h"
#include "tests/source_path.h"

namespace strobe {
namespace {

TEST(ResumeFixture, AnEarlierStrobesCheckpointResumesBitExactlyToTheStraightRun) {
  const std::string cfg = testing::source_path("tests/fixtures/resume/resume.yaml");
  const std::string fixture = testing::source_path("tests/fixtures/resume/step8.ckpt");
  const std::string dir = testing::temp_dir("resume_fixture");
  const std::string every4 = " --set callbacks.1.dirpath=" + dir + "/every4";

  // The fixture was taken mid-way through an accumulation window: one of step 9's two micro-batches
  // done, its partial gradients saved (an earlier model_checkpoint saved every_n_steps again after
  // the next step's first micro-batch when save_last was off).
  auto fx = checkpoint::load_checkpoint_file(fixture);
  ASSERT_EQ(nlohmann::json::parse(fx.blob("accumulation")).at("micro_batches").get<int64_t>(), 1);
  ASSERT_TRUE(fx.tensors.count("accumulation/grad/fc0.weight"));

  auto r = testing::strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/straight" + every4);
  ASSERT_EQ(r.code, 0) << r.err;
  // every_n_steps saves right after the batch that completes the step: no partial accumulation.
  auto at8 = checkpoint::load_checkpoint_file(dir + "/every4/step=8.ckpt");
  EXPECT_EQ(nlohmann::json::parse(at8.blob("accumulation")).at("micro_batches").get<int64_t>(), 0);
  // Where this machine computes the first 8 steps bit for bit as the machine that wrote the fixture
  // did (the straight run's own step-8 weights equal the fixture's), the continuation must be
  // bit-exact. Elsewhere (another CPU's vector kernels round differently) it must stay within 1e-5
  // relative of the straight run: a state the resume lost or misread (optimizer moments, RNG and so
  // the dropout masks, the schedule, the loader position, the partial gradients) moves the losses by
  // far more.
  const bool same_arithmetic =
      testing::bitwise_equal(testing::model_tensors(dir + "/every4/step=8.ckpt"), testing::model_tensors(fixture));
  if (!same_arithmetic)
    std::cout << "ResumeFixture: this machine's first 8 steps differ in the last bits from the fixture's; comparing "
                 "within 1e-5 relative\n";

  r = testing::strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/resumed --ckpt " + fixture + " --set callbacks.1.dirpath=" +
                          dir + "/every4_resumed");
  ASSERT_EQ(r.code, 0) << r.err;
  auto close = [&](double a, double b) { return same_arithmetic ? a == b : std::abs(a - b) <= 1e-5 * std::abs(b); };
  for (const char* column : {"train/loss", "val/loss", "val/acc"}) {
    auto straight = testing::read_csv(dir + "/straight/metrics.csv", column);
    auto resumed = testing::read_csv(dir + "/resumed/metrics.csv", column);
    ASSERT_FALSE(resumed.empty()) << column;
    int64_t compared = 0;
    for (const auto& [step, row] : resumed) {
      ASSERT_GT(step, 8) << column;
      ASSERT_TRUE(straight.count(step)) << column << " step " << step;
      if (same_arithmetic) EXPECT_EQ(row, straight.at(step)) << column << " step " << step;
      EXPECT_TRUE(close(std::stod(row.at(column)), std::stod(straight.at(step).at(column))))
          << column << " step " << step << ": resumed " << row.at(column) << ", straight " << straight.at(step).at(column);
      ++compared;
    }
    if (std::string(column) == "train/loss") EXPECT_EQ(compared, 12) << "steps 9..20";
  }
  const auto resumed_w = testing::model_tensors(dir + "/resumed/checkpoints/last.ckpt");
  const auto straight_w = testing::model_tensors(dir + "/straight/checkpoints/last.ckpt");
  ASSERT_EQ(resumed_w.size(), straight_w.size());
  for (const auto& [name, t] : straight_w) {
    ASSERT_TRUE(resumed_w.count(name)) << name;
    const auto& got = resumed_w.at(name);
    if (same_arithmetic)
      EXPECT_TRUE(torch::equal(got, t)) << name;
    else
      EXPECT_LE((got - t).abs().max().item<double>(), 1e-5 * std::max(1.0, t.abs().max().item<double>())) << name;
  }
}

// Every key of a checkpoint, "tensor <name>" or "blob <name>", sorted.
std::vector<std::string> checkpoint_keys(const checkpoint::CheckpointData& d) {
  std::vector<std::string> keys;
  for (const auto& kv : d.tensors) keys.push_back("tensor " + kv.first);
  for (const auto& kv : d.blobs) keys.push_back("blob " + kv.first);
  std::sort(keys.begin(), keys.end());
  return keys;
}

// The keys a new checkpoint writes, in full (docs/ARCHITECTURE.md, "The checkpoint layout"), for the
// fixture's experiment (bf16-master, AdamW, cosine, four callbacks, CPU): a key added, renamed or
// dropped fails here first, and the fixture written by an earlier build holds the same keys (plus
// the partial gradients and logged sums of the step it was taken in).
TEST(ResumeFixture, ANewCheckpointWritesExactlyTheDocumentedKeys) {
  const std::string cfg = testing::source_path("tests/fixtures/resume/resume.yaml");
  const std::string dir = testing::temp_dir("checkpoint_keys");
  auto r = testing::strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run --set trainer.max_steps=8 --set callbacks.1.dirpath=" +
                               dir + "/every4");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto data = checkpoint::load_checkpoint_file(dir + "/run/checkpoints/last.ckpt");
  const std::vector<std::string> want = {
      "blob accumulation", "blob callbacks", "blob config", "blob logger", "blob loop", "blob meta", "blob optimizer",
      "blob scheduler", "tensor model/fc0.bias", "tensor model/fc0.weight", "tensor model/fc1.bias",
      "tensor model/fc1.weight", "tensor model/head.bias", "tensor model/head.weight", "tensor rng/cpu",
      "tensor step/sticky"};
  const auto got = checkpoint_keys(data);
  EXPECT_EQ(got, want) << [&] {
    std::string s;
    for (const auto& k : got) s += "\"" + k + "\", ";
    return s;
  }();
  const auto meta = nlohmann::json::parse(data.blob("meta")), callbacks = nlohmann::json::parse(data.blob("callbacks"));
  std::vector<std::string> meta_keys;
  for (const auto& kv : meta.items()) meta_keys.push_back(kv.key());
  std::sort(meta_keys.begin(), meta_keys.end());
  EXPECT_EQ(meta_keys, (std::vector<std::string>{"device", "epoch", "format_version", "global_step", "precision",
                                                 "strobe_version", "world_size"}));
  std::vector<std::string> callback_keys;
  for (const auto& kv : callbacks.items()) callback_keys.push_back(kv.key());
  EXPECT_EQ(callback_keys, (std::vector<std::string>{"early_stopping[monitor=val/loss,mode=min]",
                                                     "model_checkpoint[monitor=,mode=min]",
                                                     "model_checkpoint[monitor=val/loss,mode=min]", "model_summary",
                                                     "nan_capture", "save_config"}));
  // The earlier build's fixture: the same keys, and what a checkpoint taken inside an accumulation
  // window adds (the step's partial gradients and partial logged sums).
  std::vector<std::string> fixture;
  const auto fixture_data = checkpoint::load_checkpoint_file(testing::source_path("tests/fixtures/resume/step8.ckpt"));
  for (const auto& k : checkpoint_keys(fixture_data))
    if (k.rfind("tensor accumulation/grad/", 0) != 0 && k.rfind("tensor logger/step/", 0) != 0) fixture.push_back(k);
  EXPECT_EQ(fixture, want);
}

}  // namespace
}  // namespace strobe
