// Exact resume: a run resumed from a mid-epoch checkpoint (shuffled data, two loader workers,
// dropout drawing from the global generator, AdamW + cosine) ends with bitwise the same parameters
// and logs bitwise the same losses as the run that never stopped.
#include <gtest/gtest.h>

#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

struct Straight {
  std::string dir;
  std::map<std::string, torch::Tensor> params;
};

const Straight& straight_run() {
  static Straight s = [] {
    Straight r;
    r.dir = temp_dir("straight");
    auto yaml = tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    every_n_steps: 6\n    save_top_k: -1\n";
    auto run = make_run(yaml, {}, r.dir);
    EXPECT_EQ(run->trainer->fit(), 0);
    EXPECT_EQ(run->trainer->view().state().global_step, 24);
    r.params = params_of(*run->module);
    return r;
  }();
  return s;
}

void expect_resume_matches(const std::string& ckpt_name, int64_t from_step) {
  const auto& s = straight_run();
  std::string ckpt = s.dir + "/checkpoints/" + ckpt_name;
  ASSERT_TRUE(std::filesystem::exists(ckpt)) << ckpt;
  std::string dir = temp_dir("resumed");
  auto yaml = tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    every_n_steps: 6\n    save_top_k: -1\n";
  auto run = make_run(yaml, {}, dir, ckpt);
  EXPECT_EQ(run->trainer->fit(std::move(run->checkpoint)), 0);
  EXPECT_EQ(run->trainer->view().state().global_step, 24);
  EXPECT_TRUE(bitwise_equal(params_of(*run->module), s.params)) << "parameters differ after resuming from " << ckpt_name;

  auto a = read_csv(s.dir + "/metrics.csv", "train/loss");
  auto b = read_csv(dir + "/metrics.csv", "train/loss");
  int64_t compared = 0;
  for (int64_t step = from_step + 1; step <= 24; ++step) {
    ASSERT_TRUE(a.count(step) && b.count(step)) << "step " << step << " missing";
    EXPECT_EQ(a[step]["train/loss"], b[step]["train/loss"]) << "loss at step " << step;
    ++compared;
  }
  EXPECT_EQ(compared, 24 - from_step);
}

}  // namespace

TEST(Resume, MidFirstEpochReproducesParametersAndLossesBitwise) { expect_resume_matches("step=6.ckpt", 6); }

TEST(Resume, MidSecondEpochReproducesParametersAndLossesBitwise) { expect_resume_matches("step=18.ckpt", 18); }

TEST(Resume, AtEpochBoundaryReproducesParametersBitwise) { expect_resume_matches("step=12.ckpt", 12); }

TEST(Resume, ResumeInTheSameRunDirKeepsEarlierRowsOnly) {
  const auto& s = straight_run();
  std::string dir = temp_dir("same-dir");
  std::filesystem::copy(s.dir, dir, std::filesystem::copy_options::recursive);
  auto yaml = tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    every_n_steps: 6\n    save_top_k: -1\n";
  auto run = make_run(yaml, {}, dir, dir + "/checkpoints/step=6.ckpt");
  ASSERT_EQ(run->trainer->fit(std::move(run->checkpoint)), 0);
  auto rows = read_csv(dir + "/metrics.csv", "train/loss");
  EXPECT_EQ(rows.size(), 24u);  // steps 1..24 once each: the continuation replaced rows after step 6
  EXPECT_EQ(rows, read_csv(s.dir + "/metrics.csv", "train/loss"));
}

TEST(Resume, CheckpointHoldsEverythingNeeded) {
  const auto& s = straight_run();
  auto d = checkpoint::load_checkpoint_file(s.dir + "/checkpoints/step=6.ckpt");
  for (const char* blob : {"optimizer", "scheduler", "loop", "callbacks", "config", "meta"}) EXPECT_TRUE(d.has_blob(blob)) << blob;
  EXPECT_TRUE(d.tensors.count("rng/cpu"));
  EXPECT_NE(d.blob("config").find("name: tiny"), std::string::npos);
  EXPECT_NE(d.blob("meta").find("\"global_step\":6"), std::string::npos) << d.blob("meta");
}

// A resume reads its checkpoint once: build_run reads it (for the plugins it recorded) and hands the
// loaded tensors to the trainer, so a multi-GB checkpoint is not read twice. Proved by destroying
// the file between the two: the resume still reproduces the straight run; the next resume of the
// destroyed file is refused (it is read again: nothing was kept).
TEST(Resume, TheCheckpointIsReadOnceByBuildRunAndFit) {
  const auto& s = straight_run();
  const std::string dir = temp_dir("read-once");
  const std::string ckpt = dir + "/step=12.ckpt";
  std::filesystem::copy_file(s.dir + "/checkpoints/step=12.ckpt", ckpt);
  auto yaml = tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    every_n_steps: 6\n    save_top_k: -1\n";
  auto run = make_run(yaml, {}, dir + "/run", ckpt);
  std::ofstream(ckpt, std::ios::binary | std::ios::trunc) << "destroyed";
  EXPECT_EQ(run->trainer->fit(std::move(run->checkpoint)), 0);
  EXPECT_EQ(run->trainer->view().state().global_step, 24);
  EXPECT_TRUE(bitwise_equal(params_of(*run->module), s.params));
  auto again = make_run(yaml, {}, dir + "/run2");
  try {
    again->trainer->fit(checkpoint::load_checkpoint_file(ckpt));
    FAIL() << "a destroyed checkpoint was loaded";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("not a Strobe checkpoint"), std::string::npos) << e.what();
  }
}
