// trainer.val_check_interval as a duration (docs/CONFIG.md "trainer"): validation after the first
// optimizer step that ends at least the interval of training time after the last validation, never
// at an epoch's end, the clock carried over a resume as max_time's is; a zero or unreadable duration
// is one config error. (Data parallel: TrainerDDP.ValidationByTimeHappensAfterTheSameStepsOnEveryRank.)
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "strobe/core/callback.h"
#include "strobe/core/trainer.h"
#include "tests/trainer/trainer_test_util.h"

namespace strobe {
namespace {

// Each training step takes 350 ms more; records the step after which each validation ran.
class Pace : public Callback {
 public:
  std::string name() const override { return "pace"; }
  void on_train_batch_end(TrainerView&, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(350));
  }
  void on_validation_start(TrainerView& t, Module&) override { steps.push_back(t.state().global_step); }
  std::vector<int64_t> steps;
};

}  // namespace

// 1 s at 0.35 s a step: due after step 3 (1.05 s; step 2 ends at 0.7 s), then after step 6. A run
// stopped at step 5 (0.7 s since its validation) and resumed validates after step 6 as the
// uninterrupted run does; without the carried clock it would validate after step 8 (so not by 7).
TEST(ValByTime, ValidatesAfterTheFirstStepPastTheIntervalAndCarriesTheClockOverAResume) {
  const std::string dir = testing::temp_dir("val_by_time");
  const std::vector<std::string> sets = {"trainer.val_check_interval=\"00:00:01\"", "trainer.num_sanity_val_steps=0",
                                         "data.num_workers=0", "trainer.max_epochs=-1"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), sets.begin(), sets.end());
    return more;
  };
  {
    auto pace = std::make_shared<Pace>();
    auto run = testing::make_run(testing::tiny_yaml(), with({"trainer.max_steps=7"}), dir + "/straight", std::nullopt, {pace});
    ASSERT_EQ(run->trainer->fit(), 0);
    EXPECT_EQ(pace->steps, (std::vector<int64_t>{3, 6}));
  }
  {
    auto pace = std::make_shared<Pace>();
    auto run = testing::make_run(testing::tiny_yaml(), with({"trainer.max_steps=5"}), dir + "/part", std::nullopt, {pace});
    ASSERT_EQ(run->trainer->fit(), 0);
    EXPECT_EQ(pace->steps, (std::vector<int64_t>{3}));
  }
  auto pace = std::make_shared<Pace>();
  auto run = testing::make_run(testing::tiny_yaml(), with({"trainer.max_steps=7"}), dir + "/part", dir + "/part/checkpoints/last.ckpt",
                               {pace});
  ASSERT_EQ(run->trainer->fit(std::move(run->checkpoint)), 0);
  EXPECT_EQ(pace->steps, (std::vector<int64_t>{6}));
  // An epoch's end does not validate by itself: 12 steps of 8 samples end epoch 0 at step 12.
  auto long_run =
      testing::make_run(testing::tiny_yaml(), {"trainer.val_check_interval=\"00:01:00\"", "trainer.num_sanity_val_steps=0",
                                               "data.num_workers=0", "trainer.max_steps=13"},
                        "", std::nullopt, {});
  ASSERT_EQ(long_run->trainer->fit(), 0);
  EXPECT_EQ(long_run->trainer->view().state().val_runs, 0);
}

TEST(ValByTime, AZeroOrUnreadableDurationIsOneConfigError) {
  auto err = [](const std::string& value) {
    try {
      testing::make_run(testing::tiny_yaml(), {"trainer.val_check_interval=" + value}, "");
    } catch (const config::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(err("\"00:00:00\"").find("trainer.val_check_interval: '00:00:00' is a time interval of zero"), std::string::npos)
      << err("\"00:00:00\"");
  EXPECT_NE(err("\"1:2:3:4:5\"").find("expected a count >= 1, a fraction in (0, 1] or a duration \"DD:HH:MM:SS\", got '1:2:3:4:5'"),
            std::string::npos)
      << err("\"1:2:3:4:5\"");
  EXPECT_NE(err("\"00:x0:10\"").find("a duration"), std::string::npos);
}

}  // namespace strobe
