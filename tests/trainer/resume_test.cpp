// Exact resume: a run resumed from a mid-epoch checkpoint (shuffled data, two loader workers,
// dropout drawing from the global generator, AdamW + cosine) ends with bitwise the same parameters
// and logs bitwise the same losses as the run that never stopped.
#include <numeric>
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

namespace {

// The sample indices of every training batch, with its epoch.
struct SeenIndices : Callback {
  std::string name() const override { return "seen_indices"; }
  std::vector<std::pair<int64_t, std::vector<int64_t>>> batches;
  void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch& b, int64_t) override {
    batches.emplace_back(t.state().epoch, b.indices);
  }
  std::vector<int64_t> epoch(int64_t e) const {
    std::vector<int64_t> out;
    for (const auto& [ep, idx] : batches)
      if (ep == e) out.insert(out.end(), idx.begin(), idx.end());
    return out;
  }
};

}  // namespace

// A resume with another batch (docs/DISTRIBUTED.md, "Resuming on another number of processes"): the
// epoch goes on from the samples the checkpoint's run consumed, cut into the new batches, so the two
// runs together see the epoch's order once, in order; the next epoch starts whole; a checkpoint taken
// after such a resume records where it is and resumes again (with the first batch size). The resume
// line says the old and new global batch, and a cosine keeps the checkpoint's length. 96 samples: the
// step-3 checkpoint of a batch-8 run (24 samples) resumed with batch 16 (24 -> 40, ..., 88 -> 96: 5
// batches, the last of 8), its step-6 checkpoint (after 72 samples) resumed with batch 8; and under
// limit_train_batches.
TEST(Resume, ABatchChangeGoesOnFromTheSamplesConsumed) {
  // A cosine whose length comes from the run (2 epochs of 12 batches of 8: 24 steps), which a
  // batch of 16 would make 12: the resume keeps the checkpoint's.
  std::string base = tiny_yaml();
  const std::string fixed = "  warmup_steps: 3\n  max_steps: 24\n";
  ASSERT_NE(base.find(fixed), std::string::npos);
  base.replace(base.find(fixed), fixed.size(), "  warmup_steps: 3\n");
  const auto yaml = base + "callbacks:\n  - name: model_checkpoint\n    every_n_steps: 3\n    save_top_k: -1\n";
  // The uninterrupted run (batch 8, 24 steps), whose step-3 checkpoint the others resume.
  const std::string a_dir = temp_dir("batch-a");
  auto straight = std::make_shared<SeenIndices>();
  {
    auto run = make_run(yaml, {}, a_dir, std::nullopt, {straight});
    ASSERT_EQ(run->trainer->fit(), 0);
  }
  const std::vector<int64_t> order = straight->epoch(0);
  ASSERT_EQ(order.size(), 96u);
  auto slice = [&](int64_t a, int64_t b) { return std::vector<int64_t>(order.begin() + a, order.begin() + b); };

  const std::string b_dir = temp_dir("batch-b");
  auto b = std::make_shared<SeenIndices>();
  ::testing::internal::CaptureStdout();
  int64_t b_steps = 0;
  {
    auto run = make_run(yaml, {"data.batch_size=16"}, b_dir, a_dir + "/checkpoints/step=3.ckpt", {b});
    const int code = run->trainer->fit(std::move(run->checkpoint));
    b_steps = run->trainer->view().state().global_step;
    EXPECT_EQ(code, 0);
  }
  const std::string b_out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(b_out.find("(step 3) on 1 process(es), the global batch 8 -> 16 (data.batch_size 8 x 1 process(es) x "
                       "trainer.accumulate_grad_batches 1 -> 16 x 1 x 1), epoch 0 going on after its first 24 sample(s); "
                       "the learning rate is not rescaled"),
            std::string::npos)
      << b_out;
  EXPECT_NE(b_out.find("cosine length 24 kept from the checkpoint (this run's data and limits would make it 12"),
            std::string::npos)
      << b_out;
  std::vector<size_t> sizes;
  for (const auto& [e, idx] : b->batches)
    if (e == 0) sizes.push_back(idx.size());
  EXPECT_EQ(sizes, (std::vector<size_t>{16, 16, 16, 16, 8}));
  EXPECT_EQ(b->epoch(0), slice(24, 96)) << "the rest of epoch 0's order, once";
  std::vector<int64_t> e1 = b->epoch(1);
  std::sort(e1.begin(), e1.end());
  std::vector<int64_t> all(96);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(e1, all) << "epoch 1 whole";
  EXPECT_EQ(b_steps, 3 + 5 + 6);

  // Its step-6 checkpoint (3 batches of 16 after the first 24 samples), resumed with batch 8.
  const std::string c_dir = temp_dir("batch-c");
  auto c = std::make_shared<SeenIndices>();
  ::testing::internal::CaptureStdout();
  {
    auto run = make_run(yaml, {"trainer.max_epochs=1"}, c_dir, b_dir + "/checkpoints/step=6.ckpt", {c});
    EXPECT_EQ(run->trainer->fit(std::move(run->checkpoint)), 0);
  }
  const std::string c_out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(c_out.find("the global batch 16 -> 8 (data.batch_size 16 x 1 process(es) x trainer.accumulate_grad_batches "
                       "1 -> 8 x 1 x 1), epoch 0 going on after its first 72 sample(s)"),
            std::string::npos)
      << c_out;
  EXPECT_EQ(c->epoch(0), slice(72, 96));

  // limit_train_batches (a count) keeps the epoch to that many batches of the new size from its
  // start, the 24 samples consumed counting as 2 batches of 16: 4 - 2 = 2 batches of 16 from sample 24.
  auto d = std::make_shared<SeenIndices>();
  {
    auto run = make_run(yaml, {"data.batch_size=16", "trainer.limit_train_batches=4", "trainer.max_epochs=1"},
                        temp_dir("batch-d"), a_dir + "/checkpoints/step=3.ckpt", {d});
    EXPECT_EQ(run->trainer->fit(std::move(run->checkpoint)), 0);
  }
  EXPECT_EQ(d->epoch(0), slice(24, 56));
}
