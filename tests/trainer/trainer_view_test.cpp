// TrainerView (trainer_view.h) is the whole of what a callback sees: the built-in callbacks run
// against a fake view with no Trainer behind it, and do their jobs through its members only.
#include <gtest/gtest.h>

#include <chrono>
#include <sstream>
#include <thread>

#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/config.h"
#include "strobe/core/callback.h"
#include "strobe/core/module.h"
#include "strobe/core/step_pipeline.h"
#include "strobe/core/trainer_view.h"
#include "tests/trainer/fake_view.h"

using namespace strobe;
using strobe::testing::FakeView;
using strobe::testing::ViewModule;

namespace {

std::shared_ptr<Callback> callback_from(const std::string& yaml) {
  auto doc = config::Document::load_string(yaml, "<test>");
  auto section = doc.root();
  return callback_registry().create(section, "");
}

TEST(TrainerView, EarlyStoppingDecidesFromTheViewsMetricsAndStopsThroughIt) {
  FakeView view;
  ViewModule module;
  auto cb = callback_from("name: early_stopping\nmonitor: val/loss\npatience: 2\n");
  for (double v : {1.0, 0.5, 0.6, 0.7}) {
    ++view.loop.global_step;
    view.latest["val/loss"] = v;
    cb->on_validation_end(view, module);
  }
  ASSERT_EQ(view.stops, (std::vector<int>{kExitOk})) << "two validations without improvement must stop once";
  EXPECT_EQ(cb->state_dict().at("stopped_step").get<int64_t>(), 4);
}

// The plain progress line (docs/CONFIG.md, "progress_bar"): the epoch of how many, the step the shown
// loss is from, and an ETA to the end of the run by whichever limit ends it first.
std::vector<std::string> progress_lines(FakeView& view, Callback& cb, ViewModule& module, int64_t steps) {
  ::testing::internal::CaptureStdout();
  cb.on_train_start(view, module);
  for (int64_t step = 1; step <= steps; ++step) {
    view.loop.global_step = step, view.loop.batch_in_epoch = step;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    cb.on_train_batch_end(view, module, torch::Tensor(), Batch{}, step - 1);
  }
  std::vector<std::string> lines;
  std::istringstream in(::testing::internal::GetCapturedStdout());
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(TrainerView, ProgressLineSaysTheLossStepTheEpochOfHowManyAndTheRunsEta) {
  ViewModule module;
  auto bar = callback_from("name: progress_bar\nmode: plain\n");
  FakeView view;
  view.cfg.log_every_n_steps = 5, view.cfg.max_epochs = 1, view.cfg.max_steps = 8, view.n_batches = 100000;
  view.latest["train/loss"] = 2.46291, view.latest_step["train/loss"] = 3;
  auto lines = progress_lines(view, *bar, module, 5);
  ASSERT_EQ(lines.size(), 1u);
  // max_steps ends the run after 3 more steps (under 0.1 s), long before the epoch's 99,995 batches.
  EXPECT_EQ(lines[0].rfind("epoch 0 (1 of 1) batch 5/100000 step 5 ", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find(" ETA 00:00 loss 2.463 @ step 3"), std::string::npos) << lines[0];

  FakeView epochs;  // no max_steps: the epochs left are the run's end (two of them: minutes away)
  epochs.cfg.log_every_n_steps = 5, epochs.cfg.max_epochs = 2, epochs.n_batches = 100000;
  auto bar2 = callback_from("name: progress_bar\nmode: plain\n");
  lines = progress_lines(epochs, *bar2, module, 5);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].rfind("epoch 0 (1 of 2) batch 5/100000 step 5 ", 0), 0u) << lines[0];
  EXPECT_EQ(lines[0].find("ETA 00:00"), std::string::npos) << lines[0];
  EXPECT_EQ(lines[0].find("loss"), std::string::npos) << "no loss has reached the host yet: " << lines[0];

  FakeView timed;  // max_time ends it in about a second
  timed.cfg.log_every_n_steps = 5, timed.cfg.max_epochs = -1, timed.cfg.max_time_s = 1.0, timed.n_batches = 100000;
  auto bar3 = callback_from("name: progress_bar\nmode: plain\n");
  lines = progress_lines(timed, *bar3, module, 5);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].rfind("epoch 0 batch 5/100000 step 5 ", 0), 0u) << lines[0];
  EXPECT_TRUE(lines[0].find("ETA 00:00") != std::string::npos || lines[0].find("ETA 00:01") != std::string::npos) << lines[0];
}

TEST(TrainerView, ThroughputMonitorSaysInOneReadableLineWhetherItKnowsThePeak) {
  ViewModule module;
  FakeView view;
  auto unknown = callback_from("name: throughput_monitor\n");
  ::testing::internal::CaptureStderr();
  unknown->on_fit_start(view, module);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "strobe: throughput_monitor: no dense fp32 peak is known for 'cpu', so no utilisation (throughput/mfu) is "
            "logged (set the callback's peak_tflops to have it)\n");
  auto stated = callback_from("name: throughput_monitor\npeak_tflops: 0.5\n");
  ::testing::internal::CaptureStderr();
  stated->on_fit_start(view, module);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "strobe: throughput_monitor: peak 0.5 TFLOP/s (callbacks' peak_tflops)\n");
}

TEST(TrainerView, LrMonitorReadsTheViewsOptimizerAndLogsThroughIt) {
  FakeView view;
  ViewModule module;
  view.cfg.log_every_n_steps = 2;
  view.opt = std::make_shared<torch::optim::SGD>(module.net().parameters(), torch::optim::SGDOptions(0.25));
  auto cb = callback_from("name: lr_monitor\n");
  for (int64_t step = 1; step <= 4; ++step) {
    view.loop.global_step = step;
    cb->on_train_batch_end(view, module, torch::Tensor(), Batch{}, step - 1);
  }
  // Steps 1 (always), 2 and 4 (every log_every_n_steps).
  ASSERT_EQ(view.logged.size(), 3u);
  for (const auto& [name, lr] : view.logged) {
    EXPECT_EQ(name, "lr");
    EXPECT_EQ(lr, 0.25);
  }
}

TEST(TrainerView, NanCaptureArmsItsGuardThroughStepAccessByTheViewsPrecision) {
  ViewModule module;
  for (const Precision precision : {Precision::k32, Precision::k16Mixed}) {
    FakeView view;
    view.cfg.precision = precision;
    auto cb = callback_from("name: nan_capture\n");
    cb->setup(view, module, Stage::Validate);
    EXPECT_TRUE(view.guards.empty()) << "armed outside fit";
    cb->setup(view, module, Stage::Fit);
    ASSERT_EQ(view.guards.size(), 1u) << to_string(precision);
    const auto& g = view.guards[0];
    // 16-mixed: non-finite gradients are the loss scaler's overflows; the loss is checked instead.
    EXPECT_EQ(g.check_grads, precision == Precision::k32) << to_string(precision);
    EXPECT_TRUE(g.check_loss || g.check_grads) << to_string(precision);
    EXPECT_TRUE(g.snapshot_buffers) << to_string(precision);
  }
}

}  // namespace
