// FusedAdamW / FusedAdam / FusedSGD on CPU (the ATen fallback) against torch::optim over 100
// steps, the NaN guard, the gradient multiplier, per-group learning rates and save/load in both
// directions with torch::optim.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

#include "strobe/ops/fused_optimizers.h"
#include "strobe/ops/ops.h"
#include "tests/ops/device_lr_check.h"

namespace {

using torch::Tensor;

std::vector<Tensor> make_params(uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<Tensor> ps;
  for (auto shape : std::vector<std::vector<int64_t>>{{7}, {3, 5}, {64, 33}, {1}, {2, 3, 4}}) {
    ps.push_back(torch::randn(shape, g).requires_grad_(true));
  }
  return ps;
}

std::vector<Tensor> clone_params(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const Tensor& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Same gradients into both parameter lists; `skip_every` leaves some params without a grad.
void set_grads(std::vector<Tensor>& a, std::vector<Tensor>& b, int step, int skip_every = 0) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  for (size_t i = 0; i < a.size(); ++i) {
    const Tensor grad = torch::randn(a[i].sizes(), g) * (1.0 + i);
    if (skip_every > 0 && (step + static_cast<int>(i)) % skip_every == 0) {
      a[i].mutable_grad() = Tensor();
      b[i].mutable_grad() = Tensor();
    } else {
      a[i].mutable_grad() = grad.clone();
      b[i].mutable_grad() = grad.clone();
    }
  }
}

double max_rel_diff(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = (a[i] - b[i]).abs().max().item<double>();
    const double s = std::max(b[i].abs().max().item<double>(), 1e-3);
    worst = std::max(worst, d / s);
  }
  return worst;
}

template <typename Ref, typename Fused, typename Opts>
double run_pair(const Opts& opts, int steps, int skip_every = 0) {
  auto pr = make_params(1);
  auto pf = clone_params(pr);
  Ref ref(pr, opts);
  Fused fused(pf, opts);
  for (int s = 0; s < steps; ++s) {
    set_grads(pr, pf, s, skip_every);
    ref.step();
    fused.step();
  }
  return max_rel_diff(pf, pr);
}

constexpr double kFp32Tol = 2e-5;  // fp32 rounding over 100 steps

TEST(FusedOptimizers, AdamWMatchesTorchOptimOver100Steps) {
  using torch::optim::AdamWOptions;
  EXPECT_LT((run_pair<torch::optim::AdamW, strobe::ops::FusedAdamW>(
                AdamWOptions(1e-2).weight_decay(0.1), 100)),
            kFp32Tol);
  EXPECT_LT((run_pair<torch::optim::AdamW, strobe::ops::FusedAdamW>(
                AdamWOptions(3e-3).betas({0.8, 0.95}).amsgrad(true).eps(1e-6), 100)),
            kFp32Tol);
  EXPECT_LT((run_pair<torch::optim::AdamW, strobe::ops::FusedAdamW>(AdamWOptions(1e-2), 100, 3)),
            kFp32Tol);
}

TEST(FusedOptimizers, AdamMatchesTorchOptimOver100Steps) {
  using torch::optim::AdamOptions;
  EXPECT_LT((run_pair<torch::optim::Adam, strobe::ops::FusedAdam>(
                AdamOptions(1e-2).weight_decay(0.05), 100)),
            kFp32Tol);
  EXPECT_LT((run_pair<torch::optim::Adam, strobe::ops::FusedAdam>(
                AdamOptions(1e-3).amsgrad(true).weight_decay(0.01), 100, 4)),
            kFp32Tol);
}

TEST(FusedOptimizers, SgdMatchesTorchOptimOver100Steps) {
  using torch::optim::SGDOptions;
  EXPECT_LT((run_pair<torch::optim::SGD, strobe::ops::FusedSGD>(SGDOptions(1e-2), 100)), kFp32Tol);
  EXPECT_LT((run_pair<torch::optim::SGD, strobe::ops::FusedSGD>(
                SGDOptions(1e-2).momentum(0.9).dampening(0.1).weight_decay(1e-3), 100, 3)),
            kFp32Tol);
  EXPECT_LT((run_pair<torch::optim::SGD, strobe::ops::FusedSGD>(
                SGDOptions(1e-2).momentum(0.9).nesterov(true).weight_decay(1e-3), 100)),
            kFp32Tol);
}

TEST(FusedOptimizers, FoundNonfiniteSkipsTheStepAndLeavesStateUntouched) {
  auto pr = make_params(2);
  auto pf = clone_params(pr);
  torch::optim::AdamW ref(pr, torch::optim::AdamWOptions(1e-2));
  strobe::ops::FusedAdamW fused(pf, torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < 20; ++s) {
    set_grads(pr, pf, s);
    if (s % 5 == 2) {
      // A poisoned step: the fused optimizer sees NaN grads and the flag; the reference skips it.
      for (Tensor& p : pf) p.mutable_grad().fill_(NAN);
      auto [found, norm] = strobe::ops::nonfinite_check(
          std::vector<Tensor>{pf[0].grad(), pf[1].grad()}, false);
      ASSERT_EQ(found.item<float>(), 1.f);
      const auto before = clone_params(pf);
      fused.set_found_nonfinite(found);
      fused.step();
      EXPECT_EQ(max_rel_diff(pf, before), 0.0);
      continue;
    }
    ref.step();
    fused.step();  // the flag was one-shot: this step runs
  }
  EXPECT_LT(max_rel_diff(pf, pr), kFp32Tol);
  for (const Tensor& p : pf) {
    const auto& st = static_cast<const strobe::ops::FusedAdamParamState&>(
        *fused.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(st.step().item<float>(), 16.f);
  }
}

TEST(FusedOptimizers, ZeroFlagDoesNotSkip) {
  auto pr = make_params(4);
  auto pf = clone_params(pr);
  torch::optim::SGD ref(pr, torch::optim::SGDOptions(0.1).momentum(0.5));
  strobe::ops::FusedSGD fused(pf, torch::optim::SGDOptions(0.1).momentum(0.5));
  for (int s = 0; s < 5; ++s) {
    set_grads(pr, pf, s);
    fused.set_found_nonfinite(torch::zeros({}));
    ref.step();
    fused.step();
  }
  EXPECT_LT(max_rel_diff(pf, pr), kFp32Tol);
}

TEST(FusedOptimizers, GradMultiplierScalesGradientsInsideTheStep) {
  auto pr = make_params(5);
  auto pf = clone_params(pr);
  torch::optim::Adam ref(pr, torch::optim::AdamOptions(1e-2).weight_decay(0.1));
  strobe::ops::FusedAdam fused(pf, torch::optim::AdamOptions(1e-2).weight_decay(0.1));
  for (int s = 0; s < 30; ++s) {
    set_grads(pr, pf, s);
    for (Tensor& p : pr) p.mutable_grad().mul_(0.25);
    fused.set_grad_multiplier(torch::full({}, 0.25f));
    ref.step();
    fused.step();
  }
  EXPECT_LT(max_rel_diff(pf, pr), kFp32Tol);
}

TEST(FusedOptimizers, PerGroupLearningRatesFollowTheOptionsLikeASchedulerSetsThem) {
  auto pr = make_params(6);
  auto pf = clone_params(pr);
  auto groups = [](const std::vector<Tensor>& ps) {
    std::vector<torch::optim::OptimizerParamGroup> gs;
    gs.emplace_back(std::vector<Tensor>{ps[0], ps[1]});
    gs.emplace_back(std::vector<Tensor>{ps[2], ps[3], ps[4]},
                    std::make_unique<torch::optim::AdamWOptions>(1e-3));
    return gs;
  };
  torch::optim::AdamW ref(groups(pr), torch::optim::AdamWOptions(1e-2));
  strobe::ops::FusedAdamW fused(groups(pf), torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < 40; ++s) {
    const double decay = 1.0 / (1 + s);
    for (auto* opt : std::vector<torch::optim::Optimizer*>{&ref, &fused}) {
      for (auto& g : opt->param_groups()) g.options().set_lr(g.options().get_lr() * (0.97 + 0.01 * decay));
    }
    set_grads(pr, pf, s);
    ref.step();
    fused.step();
  }
  EXPECT_LT(max_rel_diff(pf, pr), kFp32Tol);
}

template <typename A, typename B>
void save_into(const A& from, B& to) {
  std::stringstream buf;
  torch::serialize::OutputArchive out;
  from.save(out);
  out.save_to(buf);
  torch::serialize::InputArchive in;
  in.load_from(buf);
  to.load(in);
}

TEST(FusedOptimizers, SaveLoadResumesBitwiseAndInteroperatesWithTorchOptim) {
  using torch::optim::AdamWOptions;
  const auto opts = AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true);
  // Uninterrupted fused run.
  auto p0 = make_params(7);
  auto pa = clone_params(p0);
  strobe::ops::FusedAdamW a(pa, opts);
  auto dummy = clone_params(p0);
  for (int s = 0; s < 20; ++s) {
    set_grads(pa, dummy, s);
    a.step();
  }
  // Fused 10 steps, saved, loaded into a fresh fused optimizer and into torch::optim::AdamW.
  auto pb = clone_params(p0);
  strobe::ops::FusedAdamW b(pb, opts);
  for (int s = 0; s < 10; ++s) {
    set_grads(pb, dummy, s);
    b.step();
  }
  auto pc = clone_params(pb);
  strobe::ops::FusedAdamW c(pc, opts);
  save_into(b, c);
  auto pt = clone_params(pb);
  torch::optim::AdamW t(pt, opts);
  save_into(b, t);
  // And back: torch::optim state into another fused optimizer.
  auto pd = clone_params(pb);
  strobe::ops::FusedAdamW d(pd, opts);
  save_into(t, d);
  for (int s = 10; s < 20; ++s) {
    set_grads(pc, pt, s);
    set_grads(pd, dummy, s);
    c.step();
    t.step();
    d.step();
  }
  EXPECT_EQ(max_rel_diff(pc, pa), 0.0);
  EXPECT_EQ(max_rel_diff(pd, pa), 0.0);
  EXPECT_LT(max_rel_diff(pt, pa), kFp32Tol);
  EXPECT_EQ(static_cast<const torch::optim::AdamWParamState&>(
                *t.state().at(pt[0].unsafeGetTensorImpl()))
                .step(),
            20);
}

TEST(FusedOptimizers, SgdStateRoundTripsThroughTorchOptimSGD) {
  using torch::optim::SGDOptions;
  const auto opts = SGDOptions(0.05).momentum(0.9).dampening(0.2);
  auto p0 = make_params(8);
  auto pr = clone_params(p0);
  auto pf = clone_params(p0);
  torch::optim::SGD ref(pr, opts);
  torch::optim::SGD half(pf, opts);
  for (int s = 0; s < 10; ++s) {
    set_grads(pr, pf, s);
    ref.step();
    half.step();
  }
  strobe::ops::FusedSGD fused(pf, opts);
  save_into(half, fused);
  for (int s = 10; s < 30; ++s) {
    set_grads(pr, pf, s);
    ref.step();
    fused.step();
  }
  EXPECT_LT(max_rel_diff(pf, pr), kFp32Tol);
}

TEST(FusedOptimizers, FunctionalOpRejectsMismatchedLists) {
  auto ps = make_params(9);
  std::vector<Tensor> grads, m, v, steps;
  for (const Tensor& p : ps) {
    grads.push_back(torch::randn_like(p));
    m.push_back(torch::zeros_like(p));
    v.push_back(torch::zeros_like(p));
    steps.push_back(torch::zeros({}));
  }
  std::vector<Tensor> params;
  for (const Tensor& p : ps) params.push_back(p.detach());
  strobe::ops::AdamArgs args;
  std::vector<Tensor> short_m(m.begin(), m.end() - 1);
  EXPECT_THROW(strobe::ops::fused_adamw_(params, grads, short_m, v, {}, steps, args), c10::Error);
  std::vector<Tensor> bad_steps = steps;
  bad_steps[0] = torch::zeros({2});
  EXPECT_THROW(strobe::ops::fused_adamw_(params, grads, m, v, {}, bad_steps, args), c10::Error);
  args.amsgrad = true;
  EXPECT_THROW(strobe::ops::fused_adamw_(params, grads, m, v, {}, steps, args), c10::Error);
  args.amsgrad = false;
  args.lr = -1;
  EXPECT_THROW(strobe::ops::fused_adamw_(params, grads, m, v, {}, steps, args), c10::Error);
  args.lr = 1e-3;
  EXPECT_THROW(strobe::ops::fused_adamw_(params, grads, m, v, {}, steps, args, torch::ones({2})),
               c10::Error);
  EXPECT_NO_THROW(strobe::ops::fused_adamw_(params, grads, m, v, {}, steps, args));
  strobe::ops::SgdArgs sgd;
  sgd.momentum = 0.9;
  EXPECT_THROW(strobe::ops::fused_sgd_(params, grads, {}, {}, sgd), c10::Error);
  sgd.nesterov = true;
  sgd.dampening = 0.1;
  EXPECT_THROW(strobe::ops::fused_sgd_(params, grads, m, steps, sgd), c10::Error);
}

}  // namespace

TEST(FusedOptimizers, DeviceLearningRateGivesBitwiseTheHostLrStepOnCpu) {
  strobe::testing::check_device_lr_matches_host_lr(torch::kCPU);
}
