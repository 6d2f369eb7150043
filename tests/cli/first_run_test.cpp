// What a new user meets in a first hour (README, "Quickstart"; docs/CONFIG.md, "Resuming"): every
// resume says where it continues from; a schedule's length lives in the checkpoint and changes only
// when the run's length is changed on purpose, which the resume line says with the lr it moves;
// fast_dev_run claims no run directory.
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/cli/cli_test_util.h"
#include "tests/source_path.h"

using namespace strobe::testing;

namespace {

// 96 samples in batches of 8: 12 steps an epoch, two epochs, a cosine to 0 over the run's 24 steps
// (no scheduler.max_steps: the length is the run's), a checkpoint every 12 steps, lr logged each step.
std::string schedule_yaml() {
  return R"(name: schedule
seed: 3
trainer: {max_epochs: 2, log_every_n_steps: 1, num_sanity_val_steps: 0, limit_val_batches: 0, enable_progress_bar: false,
          enable_model_summary: false, device: cpu}
model: {name: mlp, in_features: 16, hidden: [8], num_classes: 2}
data: {name: synthetic_images, image_size: 4, channels: 1, num_classes: 2, num_samples: 96, num_val_samples: 8,
       batch_size: 8, num_workers: 0}
optimizer: {name: adamw, lr: 0.01}
scheduler: {name: cosine, warmup_steps: 0}
callbacks: [{name: model_checkpoint, every_n_steps: 12, save_top_k: -1}, {name: lr_monitor}]
)";
}

std::string checkpoint_at_step(const std::string& run, int step) {
  for (const auto& e : std::filesystem::directory_iterator(run + "/checkpoints"))
    if (e.path().filename().string().find("step=" + std::to_string(step) + ".ckpt") != std::string::npos) return e.path().string();
  return "";
}

double lr_at(const std::string& run, int step) {
  const auto rows = read_csv(run + "/metrics.csv", "lr");
  auto it = rows.find(step);
  return it == rows.end() ? -1.0 : std::stod(it->second.at("lr"));
}

}  // namespace

TEST(FirstRun, EveryResumeSaysWhereFromAndWhatBecameOfTheSchedule) {
  const std::string dir = temp_dir("schedule");
  const std::string cfg = write_config(schedule_yaml());
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/r1");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string at12 = dir + "/step12.ckpt";
  ASSERT_FALSE(checkpoint_at_step(dir + "/r1", 12).empty());
  std::filesystem::copy_file(checkpoint_at_step(dir + "/r1", 12), at12);

  // A plain resume: the line, nothing else.
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + at12 + " --run-dir " + dir + "/r2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("strobe fit: resuming from " + at12 + " (step 12)\n"), std::string::npos) << r.out;

  // More data makes the run longer without anyone asking for a longer schedule: the length stays.
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + at12 + " --run-dir " + dir + "/r3 --set data.num_samples=192");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("(step 12) with changes: data.num_samples: 96 -> 192; cosine length 24 kept from the checkpoint "
                       "(this run's data and limits would make it 48;"),
            std::string::npos)
      << r.out;
  // Step 18 of the kept 24-step cosine: 0.01 x (1 + cos(pi x 18/24)) / 2 = 0.00146 (stretched to 48: 0.00691).
  EXPECT_NEAR(lr_at(dir + "/r3", 18), 0.01 * 0.5 * (1 + std::cos(M_PI * 18 / 24)), 1e-9);
  EXPECT_EQ(lr_at(dir + "/r3", 30), 0.0) << "past the kept length the cosine stays at its floor";

  // A longer run asked for: the schedule stretches, and the line says so with the lr it moves.
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + at12 + " --run-dir " + dir + "/r4 --set trainer.max_epochs=3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("(step 12) with changes: trainer.max_epochs: 2 -> 3; cosine length 24 -> 36 (trainer.max_epochs: 2 -> 3): "
                       "lr 0.005 -> 0.0075; set scheduler.max_steps=24 to keep it\n"),
            std::string::npos)
      << r.out;
  EXPECT_NEAR(lr_at(dir + "/r4", 18), 0.01 * 0.5 * (1 + std::cos(M_PI * 18 / 36)), 1e-9);

  // ... and what the line suggests keeps it.
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + at12 + " --run-dir " + dir + "/r5 --set trainer.max_epochs=3 --set scheduler.max_steps=24");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("cosine length"), std::string::npos) << r.out;
  EXPECT_NEAR(lr_at(dir + "/r5", 18), 0.01 * 0.5 * (1 + std::cos(M_PI * 18 / 24)), 1e-9);
}

TEST(FirstRun, FastDevRunClaimsNoRunDirectory) {
  const std::string root = temp_dir("fast_dev_run") + "/runs";
  const std::string cfg = write_config(schedule_yaml());
  auto r = strobe_cmd("fit -c " + cfg + " --set trainer.fast_dev_run=true --set trainer.default_root_dir=" + root);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("strobe fit: fast_dev_run, no run directory (device cpu)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  no run directory (trainer.fast_dev_run writes no files)"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(root)) << "fast_dev_run claimed a version_<n> under " << root;
}

// --set scheduler.name=none on a config whose cosine has keys: the override wins, one line says
// what went (before, `scheduler.warmup_steps: unknown key`).
TEST(FirstRun, ANameChangedBySetDropsTheOldComponentsKeys) {
  const std::string cfg = write_config(schedule_yaml());
  auto r = strobe_cmd("fit -c " + cfg + " --set scheduler.name=none --set trainer.fast_dev_run=true");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("strobe: --set scheduler.name=none: dropped scheduler.warmup_steps (cosine's keys from " + cfg + ")\n"),
            std::string::npos)
      << r.err;
}

// A batch the machine cannot hold (the quickstart at data.batch_size=100000000, which the dataset
// caps at 55,000): the measured training step is refused in one line naming data.batch_size, before
// the run directory exists (before, the kernel's OOM killer ended it, exit 137, no message). Run
// under a 16 GB address-space limit, so that a regression fails instead of exhausting the machine.
TEST(FirstRun, ABatchWhoseStepCannotFitIsRefusedBeforeAnyRunFile) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const std::string run = temp_dir("big_batch") + "/run";
  auto r = shell_cmd("ulimit -v 16000000; ", "fit -c " + strobe::testing::source_path("configs/quickstart.yaml") +
                                                 " --run-dir " + run + " --set data.batch_size=100000000");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("data.batch_size: a training step on 55000 samples needs about "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(measured by a forward and backward on 2 and 4 samples: "), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_FALSE(std::filesystem::exists(run));
  // The batch the quickstart uses is not refused, and its trial leaves the run as it was: the
  // quickstart's own test (tests/python/test_quickstart.py) and every resume test train through it.
}
