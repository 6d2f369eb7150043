// TrainerView (trainer_view.h) is the whole of what a callback sees: the built-in callbacks run
// against a fake view with no Trainer behind it, and do their jobs through its members only.
#include <gtest/gtest.h>

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
