// The loops on their own (loops.h): a FitLoop and an EvaluationLoop wired to a fake view, the tiny
// experiment's data and module, and a runner that only counts, with no Trainer. They keep the
// counters, honour the limits, validate where val_check_interval says, stop on a callback's request,
// and run the evaluation hooks in Lightning's order. Then FitLoop with the real eager runner
// (StepRunner, StepPipeline, the optimizer) and still no Trainer: it owns the accumulation window
// and the optimizer steps, and trains exactly as Trainer::fit does. PredictLoop on its own runs its
// limited batches in Lightning's hook order, without gradients, and returns predict_step's outputs.
#include <gtest/gtest.h>

#include "strobe/core/engine_access.h"
#include "strobe/core/loops.h"
#include "strobe/core/optim.h"
#include "strobe/core/step_runner.h"
#include "strobe/core/trainer.h"
#include "strobe/logging/log_collector.h"
#include "tests/trainer/fake_view.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

// Records the batch it is given and does no work (the loops under test never look inside a step).
struct CountingRunner : TrainingRunner {
  std::function<void(const MicroBatch&)> on_run;
  int64_t zero_grads = 0;
  torch::Tensor run(Batch, const MicroBatch& mb) override {
    if (on_run) on_run(mb);
    return torch::zeros({});
  }
  void zero_grad() override { ++zero_grads; }
};

struct LoopRig {
  std::unique_ptr<Run> run;
  config::TrainerConfig cfg;
  FakeView view;
  logging::LogCollector collector{torch::Device(torch::kCPU)};
  std::vector<std::shared_ptr<Callback>> callbacks;
  std::unique_ptr<FitLoop> fit;
  std::unique_ptr<EvaluationLoop> eval;
  std::unique_ptr<PredictLoop> predict;
  std::vector<std::pair<int64_t, int64_t>> steps;  // (epoch, batch index) of every batch the loop ran
  CountingRunner runner;

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
    fit = std::make_unique<FitLoop>(parts, *run->strategy, 1);
    eval = std::make_unique<EvaluationLoop>(parts, fit->state());
    predict = std::make_unique<PredictLoop>(parts);
    fit->set_evaluation(eval.get());
    view.live = &fit->state();
    view.on_stop = [this](int code) { fit->request_stop(code); };
    EngineAccess::attach(*run->module, &collector, Stage::Fit, true);
    fit->setup(run->datamodule->train_loader());
    runner.on_run = [this](const MicroBatch& mb) { steps.emplace_back(fit->state().epoch, mb.index); };
    fit->set_runner(&runner);
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

// FitLoop with the eager runner and no Trainer: 2 micro-batches per optimizer step (an epoch of 12
// batches: 6 steps), the window's micro-batches flagged first / last, on_before_zero_grad once per
// step, the gradients released after each; the weights end bitwise where Trainer::fit ends them.
TEST(FitLoop, OwnsTheAccumulationWindowAndTrainsWithTheEagerRunnerAsTheTrainerDoes) {
  const std::vector<std::string> sets = {"trainer.max_epochs=1", "trainer.accumulate_grad_batches=2",
                                         "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=0",
                                         "data.num_workers=0", "scheduler={name: none}"};
  LoopRig rig(sets);
  auto& module = *rig.run->module;
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& p : module.net().named_parameters()) named.emplace_back(p.key(), p.value());
  auto opt = build_optimizer(rig.run->experiment.optimizer, make_param_groups(rig.run->experiment.optimizer, named, nullptr),
                             torch::Device(torch::kCPU));
  StepPipeline pipeline(rig.cfg, module.net(), *opt, nullptr, nullptr);
  StepRunner step(module, pipeline, torch::Device(torch::kCPU), rig.cfg.precision);
  CallbackStepHooks hooks(rig.view, module, rig.callbacks, *rig.run->strategy, *opt, rig.fit->state());
  EagerRunner eager(step, hooks, module, *opt, nullptr);
  // What the window looks like from inside a step, and after each optimizer step.
  struct Probe : TrainingRunner {
    EagerRunner& inner;
    FitLoop*& fit;
    std::vector<std::string> seen;
    Probe(EagerRunner& e, FitLoop*& f) : inner(e), fit(f) {}
    torch::Tensor run(Batch b, const MicroBatch& mb) override {
      seen.push_back(fmt::format("{}{}{}@{}", mb.index, mb.first ? "f" : "", mb.last ? "l" : "", fit->accumulated_batches()));
      return inner.run(std::move(b), mb);
    }
    void zero_grad() override {
      inner.zero_grad();
      seen.push_back(fmt::format("zero@{}", fit->state().global_step));
    }
  };
  FitLoop* fit = rig.fit.get();
  Probe probe(eager, fit);
  rig.fit->set_runner(&probe);
  rig.fit->set_optimizer(opt.get(), nullptr);  // the loop is handed its optimizer: it never asks the view
  struct ZeroGradLog : Callback {
    std::string name() const override { return "zero_grad_log"; }
    int calls = 0;
    bool grads_present = true;
    void on_before_zero_grad(TrainerView&, Module& m, torch::optim::Optimizer&) override {
      ++calls;
      for (auto& p : m.net().parameters()) grads_present &= p.grad().defined();
    }
  };
  auto zlog = std::make_shared<ZeroGradLog>();
  rig.callbacks.push_back(zlog);
  rig.fit->run();
  EXPECT_EQ(rig.fit->num_batches(), 12);
  EXPECT_EQ(rig.fit->state().global_step, 6);
  EXPECT_EQ(rig.fit->accumulated_batches(), 0);
  EXPECT_EQ(zlog->calls, 6);
  EXPECT_TRUE(zlog->grads_present) << "on_before_zero_grad saw the step's gradients";
  ASSERT_GE(probe.seen.size(), 6u);
  EXPECT_EQ(std::vector<std::string>(probe.seen.begin(), probe.seen.begin() + 6),
            (std::vector<std::string>{"0f@0", "1l@1", "zero@0", "2f@0", "3l@1", "zero@1"}));
  for (auto& p : module.net().parameters()) EXPECT_FALSE(p.grad().defined()) << "gradients left after the last step";

  auto whole = make_run(tiny_yaml(), sets, "");
  ASSERT_EQ(whole->trainer->fit(), kExitOk);
  auto a = module.net().parameters(), b = whole->module->net().parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i << ": the loop alone and Trainer::fit differ by "
                                          << (a[i] - b[i]).abs().max().item<double>();
}

TEST(PredictLoop, RunsItsLimitedBatchesInHookOrderWithoutGradientsAndReturnsTheOutputs) {
  LoopRig rig({"trainer.limit_predict_batches=2"});
  struct PredictLog : Callback {
    std::string name() const override { return "predict_log"; }
    std::vector<std::string> calls;
    std::vector<Batch> inputs;
    void on_predict_start(TrainerView&, Module&) override { calls.push_back("start"); }
    void on_predict_epoch_start(TrainerView&, Module&) override { calls.push_back("epoch_start"); }
    void on_predict_batch_start(TrainerView&, Module&, const Batch& b, int64_t i) override {
      calls.push_back(fmt::format("batch_start{}", i));
      inputs.push_back(b);
    }
    void on_predict_batch_end(TrainerView&, Module&, const torch::Tensor& y, const Batch&, int64_t i) override {
      calls.push_back(fmt::format("batch_end{}{}", i, y.requires_grad() ? " (with grad)" : ""));
    }
    void on_predict_epoch_end(TrainerView&, Module&) override { calls.push_back("epoch_end"); }
    void on_predict_end(TrainerView&, Module&) override { calls.push_back("end"); }
  };
  auto log = std::make_shared<PredictLog>();
  rig.callbacks.push_back(log);
  rig.run->datamodule->setup(Stage::Predict);
  rig.run->module->net().train();
  const auto out = rig.predict->run();
  EXPECT_EQ(log->calls, (std::vector<std::string>{"start", "epoch_start", "batch_start0", "batch_end0", "batch_start1",
                                                  "batch_end1", "epoch_end", "end"}));
  ASSERT_EQ(out.size(), 2u);
  ASSERT_EQ(log->inputs.size(), 2u);
  EXPECT_FALSE(rig.run->module->net().is_training()) << "predict runs the module in eval mode";
  torch::NoGradGuard ng;
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].size(0), log->inputs[i].batch_size());
    EXPECT_TRUE(torch::equal(out[i], rig.run->module->predict_step(log->inputs[i], int64_t(i))))
        << "output " << i << " is not predict_step of its batch";
  }
}

}  // namespace
