// StepRunner (step_runner.h): the one micro-batch the eager loop and CUDA-graph capture share. The
// hooks run in the documented order around the same device work, the optimizer step happens on the
// last micro-batch only, and the step without hooks (the captured one) computes bit for bit what the
// step with them does.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <torch/torch.h>

#include "strobe/core/step_runner.h"

using namespace strobe;

namespace {

class RunnerModule : public Module {
 public:
  RunnerModule() {
    torch::manual_seed(3);
    net_ = torch::nn::Linear(4, 1);
  }
  torch::nn::Module& net() override { return *net_; }
  torch::Tensor training_step(const Batch& batch, int64_t) override {
    ++steps;
    if (no_loss) return {};
    return torch::mse_loss(net_->forward(batch.at("x")), batch.at("y"));
  }
  torch::nn::Linear net_{nullptr};
  bool no_loss = false;
  int steps = 0;
};

Batch runner_batch(int seed) {
  torch::manual_seed(seed);
  Batch b;
  b.tensors["x"] = torch::randn({6, 4});
  b.tensors["y"] = torch::randn({6, 1});
  b.meta["batch_size"] = 6;
  return b;
}

struct HookRecorder : StepRunner::Hooks {
  std::vector<std::string> calls;
  torch::nn::Module* net = nullptr;
  bool zero_grads_before_step = false;
  void before_forward(bool last) override { calls.push_back(last ? "forward(last)" : "forward"); }
  void before_backward(const torch::Tensor& loss) override {
    calls.push_back("before_backward");
    // The loss as training_step returned it: not yet scaled for accumulation.
    EXPECT_TRUE(loss.requires_grad());
  }
  void after_backward() override { calls.push_back("after_backward"); }
  void before_optimizer_step() override {
    calls.push_back("before_optimizer_step");
    if (zero_grads_before_step)
      for (auto& p : net->parameters()) p.mutable_grad().zero_();
  }
};

struct RunnerRig {
  config::TrainerConfig cfg;
  RunnerModule module;
  std::unique_ptr<torch::optim::SGD> optimizer;
  std::unique_ptr<StepPipeline> pipeline;
  std::unique_ptr<StepRunner> runner;
  explicit RunnerRig(int64_t accumulate, StepGuard guard = {}) {
    cfg.accumulate_grad_batches = accumulate;
    optimizer = std::make_unique<torch::optim::SGD>(module.net().parameters(), torch::optim::SGDOptions(0.1));
    pipeline = std::make_unique<StepPipeline>(cfg, module.net(), *optimizer, nullptr);
    pipeline->arm(guard);
    runner = std::make_unique<StepRunner>(module, *pipeline, torch::kCPU, Precision::k32);
  }
  std::vector<torch::Tensor> params() {
    std::vector<torch::Tensor> out;
    for (auto& p : module.net().parameters()) out.push_back(p.detach().clone());
    return out;
  }
};

bool same_params(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

TEST(StepRunner, RunsTheHooksInOrderAndUpdatesOnTheLastMicroBatchOnly) {
  RunnerRig s(2);
  HookRecorder hooks;
  auto before = s.params();
  StepRunner::Options o;
  o.hooks = &hooks;
  o.first_micro_batch = true, o.last_micro_batch = false;
  auto l0 = s.runner->run(runner_batch(1), 0, o);
  EXPECT_TRUE(same_params(s.params(), before)) << "a micro-batch that does not end the step updated the weights";
  EXPECT_FALSE(l0.requires_grad()) << "the returned loss is detached";
  o.first_micro_batch = false, o.last_micro_batch = true;
  s.runner->run(runner_batch(2), 1, o);
  EXPECT_FALSE(same_params(s.params(), before)) << "the last micro-batch did not step the optimizer";
  EXPECT_EQ(hooks.calls, (std::vector<std::string>{"forward", "before_backward", "after_backward", "forward(last)",
                                                   "before_backward", "after_backward", "before_optimizer_step"}));
  EXPECT_EQ(s.pipeline->last().losses.size(), 2u) << "both micro-batches belong to one step's record";
}

TEST(StepRunner, WithoutHooksItComputesBitForBitWhatTheHookedStepDoes) {
  RunnerRig hooked(2), bare(2);
  HookRecorder hooks;
  for (int step = 0; step < 3; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      StepRunner::Options o;
      o.first_micro_batch = micro == 0, o.last_micro_batch = micro == 1;
      auto batch = runner_batch(10 * step + micro);
      StepRunner::Options with = o;
      with.hooks = &hooks;
      auto a = hooked.runner->run(batch, micro, with);
      auto b = bare.runner->run(batch, micro, o);
      ASSERT_TRUE(torch::equal(a, b)) << "step " << step << " micro-batch " << micro;
    }
    ASSERT_TRUE(same_params(hooked.params(), bare.params())) << "step " << step;
  }
  EXPECT_EQ(hooks.calls.size(), 3u * 7u);
}

TEST(StepRunner, BeforeOptimizerStepRunsBeforeTheUpdateAndSeesTheGradients) {
  // Gradients zeroed in the hook leave plain SGD's weights where they were: the hook ran before
  // the pipeline's step and the step used what the hook left.
  RunnerRig s(1);
  HookRecorder hooks;
  hooks.net = &s.module.net();
  hooks.zero_grads_before_step = true;
  auto before = s.params();
  StepRunner::Options o;
  o.hooks = &hooks;
  s.runner->run(runner_batch(4), 0, o);
  EXPECT_TRUE(same_params(s.params(), before));
  hooks.zero_grads_before_step = false;
  s.runner->run(runner_batch(5), 1, o);
  EXPECT_FALSE(same_params(s.params(), before));
}

TEST(StepRunner, ANoLossStepRunsNoBackwardAndIsRefusedWhereALossIsRequired) {
  RunnerRig s(1);
  s.module.no_loss = true;
  HookRecorder hooks;
  auto before = s.params();
  StepRunner::Options o;
  o.hooks = &hooks;
  auto loss = s.runner->run(runner_batch(6), 0, o);
  EXPECT_FALSE(loss.defined());
  EXPECT_EQ(hooks.calls, (std::vector<std::string>{"forward(last)", "before_optimizer_step"}));
  EXPECT_TRUE(same_params(s.params(), before));
  o.require_loss = true;
  try {
    s.runner->run(runner_batch(7), 1, o);
    FAIL() << "a required loss that is missing was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no loss"), std::string::npos) << e.what();
  }
}

TEST(StepRunner, TheArmedGuardSeesEveryMicroBatchOfTheStep) {
  // A non-finite first micro-batch makes the whole step non-finite and skipped: begin_step ran once,
  // at the first micro-batch, and the loss check covers both.
  StepGuard guard;
  guard.check_loss = true;
  RunnerRig s(2, guard);
  auto before = s.params();
  StepRunner::Options o;
  auto bad = runner_batch(8);
  bad.tensors["y"][0][0] = std::numeric_limits<float>::quiet_NaN();
  o.first_micro_batch = true, o.last_micro_batch = false;
  s.runner->run(bad, 0, o);
  o.first_micro_batch = false, o.last_micro_batch = true;
  s.runner->run(runner_batch(9), 1, o);
  EXPECT_EQ(s.pipeline->last().nonfinite.item<float>(), 1.0f);
  EXPECT_TRUE(same_params(s.params(), before)) << "a step with a non-finite micro-batch was applied";
  EXPECT_EQ(s.module.steps, 2);
}

}  // namespace
