// The loops on their own (loops.h): a FitLoop and an EvaluationLoop wired to a fake view, the tiny
// experiment's data and module, and a step that only counts, with no Trainer. They keep the counters, honour the
// limits, validate where val_check_interval says, stop on a callback's request, and run the
// evaluation hooks in Lightning's order.
#include <gtest/gtest.h>

#include "framework/core/loops.h"
#include "framework/logging/log_collector.h"
#include "tests/trainer/fake_view.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

struct LoopRig {
  std::unique_ptr<Run> run;
  config::TrainerConfig cfg;
  FakeView view;
  logging::LogCollector collector{torch::Device(torch::kCPU)};
  std::vector<std::shared_ptr<Callback>> callbacks;
  std::unique_ptr<FitLoop> fit;
  std::unique_ptr<EvaluationLoop> eval;
  std::vector<std::pair<int64_t, int64_t>> steps;  // (epoch, batch index) of every batch the loop ran

  explicit LoopRig(const std::vector<std::string>& sets) {
    run = make_run(tiny_yaml(), sets, "");
    cfg = run->experiment.trainer;
    run->datamodule->setup(Stage::Fit);
    LoopParts parts;
    parts.view = &view;
    parts.module = run->module.get();
    parts.datamodule = run->datamodule.get();
    parts.collector = &collector;
    parts.cfg = &cfg;
    parts.callbacks = &callbacks;
    parts.prepare_batch = [](Batch b, int64_t) { return b; };
    fit = std::make_unique<FitLoop>(parts, *run->strategy, 1);
    eval = std::make_unique<EvaluationLoop>(parts, fit->state());
    fit->set_evaluation(eval.get());
    view.live = &fit->state();
    view.on_stop = [this](int code) { fit->request_stop(code); };
    run->module->attach(&collector, Stage::Fit, true);
    fit->setup(run->datamodule->train_loader());
    // The step: it records the batch and counts one optimizer step, as the Trainer's does without
    // accumulation (the loops under test never look inside a step).
    fit->set_run_batch([this](Batch, int64_t idx) {
      steps.emplace_back(fit->state().epoch, idx);
      ++fit->state().global_step;
      return torch::zeros({});
    });
  }
};

struct HookLog : Callback {
  std::string name() const override { return "hook_log"; }
  std::vector<std::string> calls;
  std::function<void(TrainerView&)> at_batch_end;
  void on_train_epoch_start(TrainerView& t, Module&) override { calls.push_back(fmt::format("epoch_start@{}", t.state().epoch)); }
  void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    if (at_batch_end) at_batch_end(t);
  }
  void on_validation_start(TrainerView& t, Module&) override { calls.push_back(fmt::format("val_start@{}", t.state().global_step)); }
  void on_validation_batch_start(TrainerView&, Module&, const Batch&, int64_t i) override { calls.push_back(fmt::format("val_batch{}", i)); }
  void on_validation_epoch_end(TrainerView&, Module&) override { calls.push_back("val_epoch_end"); }
  void on_validation_end(TrainerView& t, Module&) override { calls.push_back(fmt::format("val_end@{}", t.state().global_step)); }
  void on_train_epoch_end(TrainerView& t, Module&) override { calls.push_back(fmt::format("epoch_end@{}", t.state().global_step)); }
};

TEST(FitLoop, RunsEpochsOfItsLimitedBatchesAndKeepsTheCounters) {
  LoopRig rig({"trainer.limit_train_batches=5", "trainer.max_epochs=2", "trainer.limit_val_batches=0"});
  EXPECT_EQ(rig.fit->num_batches(), 5);
  EXPECT_EQ(rig.fit->estimated_stepping_batches(), 10);
  rig.fit->start_clock();
  rig.fit->run();
  std::vector<std::pair<int64_t, int64_t>> want;
  for (int64_t e = 0; e < 2; ++e)
    for (int64_t i = 0; i < 5; ++i) want.emplace_back(e, i);
  EXPECT_EQ(rig.steps, want);
  const auto& s = rig.fit->state();
  EXPECT_EQ(s.epoch, 1);
  EXPECT_TRUE(s.epoch_done);
  EXPECT_EQ(s.batch_in_epoch, 5);
  EXPECT_EQ(s.batches_seen, 10);
  EXPECT_EQ(s.global_step, 10);
  EXPECT_EQ(s.val_runs, 0);
  EXPECT_TRUE(rig.fit->done());
  EXPECT_EQ(rig.fit->settle_stop(), 0);
  EXPECT_EQ(rig.fit->exit_code(), kExitOk);
}

TEST(FitLoop, ValidatesWhereValCheckIntervalSaysThroughItsEvaluationLoop) {
  LoopRig rig({"trainer.limit_train_batches=5", "trainer.max_epochs=2", "trainer.val_check_interval=2",
               "trainer.limit_val_batches=1"});
  auto log = std::make_shared<HookLog>();
  rig.callbacks.push_back(log);
  rig.fit->run();
  EXPECT_EQ(log->calls, (std::vector<std::string>{"epoch_start@0", "val_start@2", "val_batch0", "val_epoch_end", "val_end@2",
                                                  "val_start@4", "val_batch0", "val_epoch_end", "val_end@4", "epoch_end@5",
                                                  "epoch_start@1", "val_start@7", "val_batch0", "val_epoch_end", "val_end@7",
                                                  "val_start@9", "val_batch0", "val_epoch_end", "val_end@9", "epoch_end@10"}));
  EXPECT_EQ(rig.fit->state().val_runs, 4);
  EXPECT_TRUE(rig.run->module->net().is_training()) << "validation left the module in eval mode";
}

TEST(FitLoop, ACallbacksStopRequestEndsTheRunAfterThatStepWithItsCode) {
  for (int code : {int(kExitOk), int(kExitNaN)}) {
    LoopRig rig({"trainer.limit_train_batches=5", "trainer.max_epochs=3", "trainer.limit_val_batches=0"});
    auto log = std::make_shared<HookLog>();
    log->at_batch_end = [code](TrainerView& t) {
      if (t.state().global_step == 7) t.request_stop(code);
    };
    rig.callbacks.push_back(log);
    rig.fit->run();
    EXPECT_EQ(rig.fit->state().global_step, 7) << code;
    EXPECT_EQ(rig.fit->state().epoch, 1) << code;
    EXPECT_TRUE(rig.fit->should_stop());
    EXPECT_EQ(rig.fit->settle_stop(), 0);
    EXPECT_EQ(rig.fit->exit_code(), code);
  }
}

TEST(FitLoop, MaxStepsEndsTheRunMidEpochAndAResumedLoopContinuesWithTheNextBatch) {
  LoopRig a({"trainer.limit_train_batches=5", "trainer.max_steps=7", "trainer.max_epochs=-1", "trainer.limit_val_batches=0"});
  a.fit->run();
  EXPECT_EQ(a.fit->state().global_step, 7);
  EXPECT_EQ(a.fit->state().batch_in_epoch, 2);
  // A loop given those counters (a resume) runs on from epoch 1, batch 2.
  LoopRig b({"trainer.limit_train_batches=5", "trainer.max_steps=9", "trainer.max_epochs=-1", "trainer.limit_val_batches=0"});
  b.fit->state() = a.fit->saved_state();
  b.fit->run();
  EXPECT_EQ(b.steps, (std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {1, 3}}));
  EXPECT_EQ(b.fit->state().batches_seen, 9);
}

TEST(EvaluationLoop, RunsItsLimitedBatchesCountsRealRunsAndRestoresTrainMode) {
  LoopRig rig({"trainer.limit_val_batches=2"});
  auto log = std::make_shared<HookLog>();
  rig.callbacks.push_back(log);
  rig.run->module->net().train();
  EXPECT_EQ(rig.eval->planned_batches(Stage::Validate, -1), 2);
  EXPECT_EQ(rig.eval->planned_batches(Stage::Validate, 1), 1);
  EXPECT_EQ(rig.eval->run(Stage::Validate, -1, /*sanity=*/true), 2);
  EXPECT_EQ(rig.fit->state().val_runs, 0) << "a sanity check is no validation run";
  EXPECT_EQ(rig.collector.latest().count("val/loss"), 0u) << "the sanity check's metrics were delivered";
  EXPECT_EQ(rig.eval->run(Stage::Validate, 1, false), 1);
  EXPECT_EQ(rig.fit->state().val_runs, 1);
  EXPECT_TRUE(rig.run->module->net().is_training());
  EXPECT_EQ(log->calls, (std::vector<std::string>{"val_start@0", "val_batch0", "val_batch1", "val_epoch_end", "val_end@0",
                                                  "val_start@0", "val_batch0", "val_epoch_end", "val_end@0"}));
  EXPECT_EQ(rig.collector.latest().count("val/loss"), 1u) << "the validation's metrics were not delivered";
  EXPECT_EQ(rig.eval->run(Stage::Test, 0, false), 0) << "a limit of 0 runs nothing";
}

}  // namespace
