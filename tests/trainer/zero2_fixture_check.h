// tests/fixtures/zero2 (README there): a checkpoint two ranks wrote under zero2, its AdamW moments in
// two shard files, resumed in one process with data.batch_size 8 (the global batch 16 kept): the
// optimizer state re-cut from the shards into a whole one (docs/DISTRIBUTED.md, "Checkpoints under
// zero2"). The resumed run ends on an uninterrupted one-process run's weights within `tolerance`
// (relative to the largest value; the fixture's first 3 steps reduced a mean of two means of 4, the
// straight run one mean of 8). Moments restarted from zero move the weights by ~lr (1e-2) a step,
// far past it. Shared by tests/trainer (CPU) and tests/gpu_trainer (CUDA).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "tests/cli/cli_test_util.h"
#include "tests/source_path.h"
#include "tests/trainer/trainer_test_util.h"

namespace strobe::testing {

inline void expect_zero2_fixture_resumes(const std::string& device, double tolerance) {
  const std::string cfg = source_path("tests/fixtures/zero2/zero2.yaml");
  const std::string fixture = source_path("tests/fixtures/zero2/last.ckpt");
  const std::string dir = temp_dir("zero2_fixture_" + device);
  const std::string sets = " --set data.batch_size=8 --set trainer.device=" + device;
  auto straight = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/straight" + sets);
  ASSERT_EQ(straight.code, 0) << straight.err;
  auto resumed = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/resumed --ckpt " + fixture + sets);
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("(step 3) on 2 process(es) -> 1, the global batch 16 kept (data.batch_size 4 -> 8)"),
            std::string::npos)
      << resumed.out;
  const auto want = model_tensors(dir + "/straight/checkpoints/last.ckpt");
  const auto got = model_tensors(dir + "/resumed/checkpoints/last.ckpt");
  const auto at3 = model_tensors(fixture);
  ASSERT_EQ(got.size(), want.size());
  double moved = 0;
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    const torch::Tensor g = got.at(name).cpu();
    EXPECT_LE((g - t.cpu()).abs().max().item<double>(), tolerance * t.abs().max().item<double>()) << name << " on " << device;
    moved = std::max(moved, (g - at3.at(name)).abs().max().item<double>());
  }
  EXPECT_GT(moved, 1e-3) << "the resumed run did not train";
}

}  // namespace strobe::testing
