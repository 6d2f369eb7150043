// CUDA kernels of the strobe ops against float64 references (fresh random inputs per case; the
// caching allocator is poisoned with NaN first so any output element a kernel forgets to write
// shows up), and the fused optimizers against torch::optim on the same GPU.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/fused_optimizers.h"
#include "strobe/ops/ops.h"
#include "tests/gpu_test_util.h"
#include "tests/ops/device_lr_check.h"

namespace {

using torch::Tensor;
namespace idx = torch::indexing;

using strobe::testing::kCuda;
using strobe::testing::poison_allocator;
using strobe::testing::rel_err;

std::pair<Tensor, Tensor> make_boxes(int64_t b, int64_t n, int64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  // About half the rows valid so both padding and real boxes are exercised at every N.
  const Tensor count = torch::randint(0, n + 1, {b}, g);
  const Tensor tl = torch::randint(0, 255, {b, n, 2}, g);
  const Tensor br = torch::clamp(tl + torch::randint(1, 256, {b, n, 2}, g), 0, 255);
  const Tensor valid = torch::arange(n).unsqueeze(0) < count.unsqueeze(1);
  const Tensor t = torch::cat({tl, br}, -1).to(torch::kFloat) * valid.unsqueeze(-1);
  const Tensor ptl = torch::rand({b, n, 2}, g) * 200;
  const Tensor p = torch::cat({ptl, ptl + 1 + torch::rand({b, n, 2}, g) * 50}, -1);
  return {p, t};
}

struct Out {
  Tensor loss, grad;
};

Out run(const Tensor& pred, const Tensor& target, const std::string& r, const Tensor& offsets = {}) {
  Tensor p = pred.detach().clone().requires_grad_(true);
  Tensor loss = offsets.defined() ? strobe::ops::giou_loss_packed(p, target, offsets, r)
                                  : strobe::ops::giou_loss(p, target, r);
  const Tensor seed = r == "none" ? torch::linspace(-1, 1, loss.numel(), loss.options()).reshape(loss.sizes())
                                  : torch::ones({}, loss.options());
  loss.backward(seed);
  return {loss.detach(), p.grad()};
}

double bound(torch::Dtype d) { return d == torch::kFloat ? 1e-5 : 1e-2; }

// The float64 reference below is the CPU op (standard GIoU, tested in tests/ops against autograd
// of the clamped formula).
TEST(GiouLossCuda, MatchesFloat64ReferenceForAllShapesDtypesAndReductions) {
  SKIP_WITHOUT_CUDA();
  int64_t seed = 0;
  for (torch::Dtype dt : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (int64_t n : {1, 7, 256, 1000}) {
      for (int64_t b : {1, 3, 1024}) {
        for (const std::string r : {"mean", "sum", "none"}) {
          auto [p, t] = make_boxes(b, n, ++seed);
          const Tensor pd = p.to(dt);  // the reference sees the rounded predictions
          const Out want = run(pd.to(torch::kDouble), t.to(torch::kDouble), r);
          poison_allocator();
          const Out got = run(pd.to(kCuda), t.to(kCuda), r);
          EXPECT_EQ(got.grad.scalar_type(), dt);
          EXPECT_LT(rel_err(got.loss, want.loss), bound(dt)) << dt << " B=" << b << " N=" << n << " " << r;
          // The gradient has pred's dtype: compare with the reference rounded to it (fp16 gradients
          // of a mean over many boxes are fp16 subnormals or 0).
          EXPECT_LT(rel_err(got.grad, want.grad.to(dt)), bound(dt)) << dt << " B=" << b << " N=" << n << " " << r;
        }
      }
    }
  }
}

TEST(GiouLossCuda, TargetsOfAnyFloatTypeAreReadNatively) {
  SKIP_WITHOUT_CUDA();
  auto [p, t] = make_boxes(8, 100, 77);
  const Out want = run(p.to(torch::kDouble), t.to(torch::kDouble), "mean");
  for (torch::Dtype td : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16}) {
    // Box coordinates are small integers: exact in every type.
    const Out got = run(p.to(kCuda), t.to(kCuda, td), "mean");
    EXPECT_LT(rel_err(got.loss, want.loss), 1e-5) << td;
    EXPECT_LT(rel_err(got.grad, want.grad), 1e-5) << td;
  }
}

TEST(GiouLossCuda, EmptyImagesAllInvalidBatchesAndDegenerateBoxesHaveNoNaN) {
  SKIP_WITHOUT_CUDA();
  auto [p, t] = make_boxes(16, 33, 5);
  t.index_put_({idx::Slice(0, 8)}, 0.0);
  const Tensor invalid = (t.index({idx::Ellipsis, 3}) <= 0).unsqueeze(-1).expand_as(p);
  const Tensor pn = torch::where(invalid, torch::full_like(p, NAN), p);
  const Out want = run(p.to(torch::kDouble), t.to(torch::kDouble), "mean");
  poison_allocator();
  const Out got = run(pn.to(kCuda), t.to(kCuda), "mean");
  EXPECT_LT(rel_err(got.loss, want.loss), 1e-5);
  EXPECT_LT(rel_err(got.grad, want.grad), 1e-5);
  for (const std::string r : {"mean", "sum"}) {
    const Out zero = run(p.to(kCuda), torch::zeros_like(t).to(kCuda), r);
    EXPECT_EQ(zero.loss.item<float>(), 0.f);
    EXPECT_EQ(zero.grad.abs().max().item<float>(), 0.f);
  }
  const Tensor td = torch::tensor({{{10., 10., 20., 20.}, {5., 5., 5., 9.}, {0., 0., 4., 4.}, {3., 3., 3., 3.}}});
  const Tensor pdg = torch::tensor({{{10., 10., 20., 20.}, {5., 5., 5., 9.}, {50., 60., 70., 80.}, {3., 3., 3., 3.}}});
  const Out wd = run(pdg, td, "none");
  const Out gd = run(pdg.to(kCuda, torch::kFloat), td.to(kCuda), "none");
  EXPECT_TRUE(torch::isfinite(gd.grad).all().item<bool>());
  EXPECT_LT(rel_err(gd.loss, wd.loss), 1e-6);
  EXPECT_LT(rel_err(gd.grad, wd.grad), 1e-6);
}

// Standard GIoU(target, pred) per box (intersection sides clamped at 0, as
// torchvision.ops.generalized_box_iou; eps 1e-5 on union and hull), for float64 autograd.
Tensor giou_clamped(const Tensor& t, const Tensor& p) {
  auto lo = [](const Tensor& x) { return x.index({idx::Ellipsis, idx::Slice(0, 2)}); };
  auto hi = [](const Tensor& x) { return x.index({idx::Ellipsis, idx::Slice(2, 4)}); };
  const Tensor inter = (torch::min(hi(t), hi(p)) - torch::max(lo(t), lo(p))).clamp_min(0).prod(-1);
  const Tensor uni = (hi(t) - lo(t)).prod(-1) + (hi(p) - lo(p)).prod(-1) - inter;
  const Tensor hull = (torch::max(hi(t), hi(p)) - torch::min(lo(t), lo(p))).prod(-1).clamp_min(1e-5);
  return inter / uni.clamp_min(1e-5) - (hull - uni) / hull;
}

TEST(GiouLossCuda, BoxesDisjointOnBothAxesGiveAFiniteLossAndGradient) {
  SKIP_WITHOUT_CUDA();
  // The seed's unclamped overlap gives ~2e7 on the second box (positive "intersection" of two
  // negative sides, union < eps); the standard GIoU is in [-1, 1].
  const Tensor t = torch::tensor({{{0., 0., 1e-3, 1e-3}, {0., 0., 10., 10.}, {100., 100., 110., 120.},
                                   {0., 0., 4., 4.}, {50., 50., 51., 51.}}}, torch::kDouble);
  const Tensor p = torch::tensor({{{2e-3, 2e-3, 3e-3, 3e-3}, {20., 30., 25., 31.}, {0., 0., 90., 95.},
                                   {4.5, 4.5, 5., 5.}, {51.001, 51.001, 51.002, 51.002}}}, torch::kDouble);
  for (torch::Dtype dt : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    const Tensor pd = p.to(dt);
    Tensor rp = pd.to(torch::kDouble).requires_grad_(true);
    const Tensor ref = giou_clamped(t, rp);
    ref.backward(torch::linspace(-1, 1, ref.numel(), torch::kDouble).reshape(ref.sizes()));
    poison_allocator();
    const Out got = run(pd.to(kCuda), t.to(kCuda, torch::kFloat), "none");
    EXPECT_TRUE(torch::isfinite(got.loss).all().item<bool>()) << dt;
    EXPECT_TRUE(torch::isfinite(got.grad).all().item<bool>()) << dt;
    EXPECT_TRUE(((got.loss >= -1) & (got.loss <= 1)).all().item<bool>()) << dt << got.loss;
    EXPECT_LT(rel_err(got.loss, ref.detach()), bound(dt)) << dt;
    EXPECT_LT(rel_err(got.grad, rp.grad().to(dt)), bound(dt)) << dt;
    const Out mean = run(pd.to(kCuda), t.to(kCuda, torch::kFloat), "mean");
    const double m = mean.loss.item<double>();
    EXPECT_TRUE(std::isfinite(m) && m >= -1 && m <= 1) << dt << " " << m;
    EXPECT_TRUE(torch::isfinite(mean.grad).all().item<bool>()) << dt;
  }
}

TEST(GiouLossCuda, PackedLayoutsMatchTheCpuReference) {
  SKIP_WITHOUT_CUDA();
  const int64_t b = 300, n = 64;
  auto g = at::make_generator<at::CPUGeneratorImpl>(9);
  Tensor counts = torch::randint(0, n + 1, {b}, g);
  counts.index_put_({idx::Slice(0, 10)}, 0);  // empty images
  const Tensor off = torch::cat({torch::zeros({1}, torch::kLong), counts.cumsum(0)});
  const int64_t total = off[-1].item<int64_t>();
  const Tensor tl = torch::randint(0, 200, {total, 2}, g).to(torch::kFloat);
  const Tensor packed = torch::cat({tl, tl + 1 + torch::randint(0, 50, {total, 2}, g)}, 1);
  const Tensor pred = torch::rand({b, n, 4}, g) * 100 + torch::tensor({0.f, 0.f, 60.f, 60.f});
  for (const std::string r : {"mean", "none"}) {
    // The reference sees the same bf16-rounded predictions; its gradient is rounded to bf16 too.
    const Tensor pb = pred.to(torch::kBFloat16);
    const Out want = run(pb.to(torch::kDouble), packed, r, off);
    poison_allocator();
    const Out got = run(pb.to(kCuda), packed.to(kCuda), r, off.to(kCuda));
    EXPECT_LT(rel_err(got.loss, want.loss), 1e-2) << r;
    EXPECT_LT(rel_err(got.grad, want.grad.to(torch::kBFloat16)), 1e-2) << r;
    const Tensor pp = pred.reshape({-1, 4}).slice(0, 0, total);
    const Tensor off2 = torch::tensor({int64_t{0}, total});
    const Out want2 = run(pp.to(torch::kDouble), packed, r, off2);
    const Out got2 = run(pp.to(kCuda), packed.to(kCuda), r, off2.to(kCuda));
    EXPECT_LT(rel_err(got2.loss, want2.loss), 1e-5) << r;
    EXPECT_LT(rel_err(got2.grad, want2.grad), 1e-5) << r;
  }
}

TEST(GiouLossCuda, LossIsBitwiseDeterministic) {
  SKIP_WITHOUT_CUDA();
  auto [p, t] = make_boxes(4096, 256, 1);
  const Out a = run(p.to(kCuda), t.to(kCuda), "mean");
  for (int i = 0; i < 5; ++i) {
    const Out b = run(p.to(kCuda), t.to(kCuda), "mean");
    EXPECT_TRUE(torch::equal(a.loss, b.loss));
    EXPECT_TRUE(torch::equal(a.grad, b.grad));
  }
}

TEST(NonfiniteCheckCuda, FlagAndNormMatchTheCpuOverManyMixedTensors) {
  SKIP_WITHOUT_CUDA();
  for (int trial = 0; trial < 6; ++trial) {
    torch::manual_seed(trial);
    std::vector<Tensor> ts;
    const int count = trial < 3 ? 37 : 2100;  // > kNonfiniteMaxTensors takes several launches
    for (int i = 0; i < count; ++i) {
      const int64_t numel = torch::randint(0, trial % 2 ? 100000 : 300, {1}).item<int64_t>();
      const torch::Dtype dt = std::vector<torch::Dtype>{torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble}[i % 4];
      Tensor t = torch::randn({numel}).to(dt);
      if (i % 7 == 3 && numel > 3) t = t.slice(0, 1);  // misaligned view
      ts.push_back(t.to(kCuda));
    }
    const bool inject = trial % 3 != 0;
    if (inject) {
      Tensor& victim = ts[torch::randint(0, count, {1}).item<int64_t>()];
      if (victim.numel() == 0) victim = torch::ones({5}, victim.options());
      victim.view({-1})[torch::randint(0, victim.numel(), {1}).item<int64_t>()] = trial % 2 ? NAN : -INFINITY;
    }
    std::vector<Tensor> cpu;
    for (const Tensor& t : ts) cpu.push_back(t.cpu());
    poison_allocator();
    auto [found, norm] = strobe::ops::nonfinite_check(ts, true);
    auto [cfound, cnorm] = strobe::ops::nonfinite_check(cpu, true);
    EXPECT_EQ(found.item<float>(), inject ? 1.f : 0.f) << trial;
    EXPECT_EQ(found.item<float>(), cfound.item<float>());
    if (!inject) EXPECT_LT(rel_err(norm, cnorm), 1e-5) << trial;
  }
}

std::vector<Tensor> cuda_params(uint64_t seed, int count) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<Tensor> ps;
  for (int i = 0; i < count; ++i) {
    const int64_t n = (i * 7919) % 5000 + 1;
    ps.push_back(torch::randn({n}, g).to(kCuda).requires_grad_(true));
  }
  ps.push_back(torch::randn({1024, 1023}, g).to(kCuda).requires_grad_(true));
  return ps;
}

std::vector<Tensor> clone_params(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const Tensor& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

double max_rel_diff(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = (a[i] - b[i]).abs().max().item<double>();
    worst = std::max(worst, d / std::max(b[i].abs().max().item<double>(), 1e-3));
  }
  return worst;
}

// 100 steps on CUDA against torch::optim on CUDA; grads in `grad_dtype` for the fused side (the
// reference gets the same values in fp32); every 10th step is poisoned and flagged.
template <typename Ref, typename Fused, typename Opts>
void compare_on_cuda(const Opts& opts, torch::Dtype grad_dtype, int count) {
  auto pr = cuda_params(1, count);
  auto pf = clone_params(pr);
  Ref ref(pr, opts);
  Fused fused(pf, opts);
  for (int s = 0; s < 100; ++s) {
    for (size_t i = 0; i < pr.size(); ++i) {
      const Tensor g = torch::randn(pr[i].sizes(), pr[i].options()).to(grad_dtype);
      pr[i].mutable_grad() = g.to(torch::kFloat);
      pf[i].mutable_grad() = g;
    }
    if (s % 10 == 9) {
      pf[0].mutable_grad().view({-1})[0] = NAN;
      auto [found, norm] = strobe::ops::nonfinite_check(std::vector<Tensor>{pf[0].grad()}, false);
      fused.set_found_nonfinite(found);
      fused.step();
      continue;
    }
    ref.step();
    fused.step();
  }
  EXPECT_LT(max_rel_diff(pf, pr), 2e-5) << grad_dtype << " tensors=" << pr.size();
}

TEST(FusedOptimizersCuda, AdamWMatchesTorchOptimOver100StepsWithSkippedSteps) {
  SKIP_WITHOUT_CUDA();
  using torch::optim::AdamWOptions;
  compare_on_cuda<torch::optim::AdamW, strobe::ops::FusedAdamW>(AdamWOptions(1e-3).weight_decay(0.05), torch::kFloat, 20);
  compare_on_cuda<torch::optim::AdamW, strobe::ops::FusedAdamW>(AdamWOptions(1e-3).amsgrad(true), torch::kBFloat16, 20);
  compare_on_cuda<torch::optim::AdamW, strobe::ops::FusedAdamW>(AdamWOptions(1e-3), torch::kHalf, 700);  // several launches
}

TEST(FusedOptimizersCuda, AdamAndSgdMatchTorchOptimOver100Steps) {
  SKIP_WITHOUT_CUDA();
  compare_on_cuda<torch::optim::Adam, strobe::ops::FusedAdam>(torch::optim::AdamOptions(1e-3).weight_decay(0.01), torch::kFloat, 20);
  compare_on_cuda<torch::optim::SGD, strobe::ops::FusedSGD>(torch::optim::SGDOptions(1e-2).momentum(0.9).dampening(0.1).weight_decay(1e-4), torch::kFloat, 20);
  compare_on_cuda<torch::optim::SGD, strobe::ops::FusedSGD>(torch::optim::SGDOptions(1e-2).momentum(0.9).nesterov(true), torch::kBFloat16, 600);
  compare_on_cuda<torch::optim::SGD, strobe::ops::FusedSGD>(torch::optim::SGDOptions(1e-2), torch::kFloat, 20);
}

// channels_last parameters (resnet on CUDA) are dense but not contiguous: the fused step updates
// them in place with moments laid out like them, from channels_last or contiguous gradients, and
// matches torch::optim on the same values; the non-finite check reads them without copies.
TEST(FusedOptimizersCuda, ChannelsLastParametersAreUpdatedInPlace) {
  SKIP_WITHOUT_CUDA();
  const auto cl = at::MemoryFormat::ChannelsLast;
  for (bool sgd : {true, false}) {
    std::vector<Tensor> pr, pf;
    for (auto shape : {std::vector<int64_t>{64, 32, 3, 3}, std::vector<int64_t>{16, 3, 7, 7}, std::vector<int64_t>{256, 64, 1, 1}}) {
      Tensor w = torch::randn(shape, torch::TensorOptions(kCuda));
      pr.push_back(w.clone().requires_grad_(true));
      pf.push_back(w.contiguous(cl).requires_grad_(true));
    }
    const void* before = pf[0].data_ptr();
    std::unique_ptr<torch::optim::Optimizer> ref, fused;
    if (sgd) {
      ref = std::make_unique<torch::optim::SGD>(pr, torch::optim::SGDOptions(1e-2).momentum(0.9));
      fused = std::make_unique<strobe::ops::FusedSGD>(pf, torch::optim::SGDOptions(1e-2).momentum(0.9));
    } else {
      ref = std::make_unique<torch::optim::AdamW>(pr, torch::optim::AdamWOptions(1e-2));
      fused = std::make_unique<strobe::ops::FusedAdamW>(pf, torch::optim::AdamWOptions(1e-2));
    }
    for (int s = 0; s < 30; ++s) {
      for (size_t i = 0; i < pr.size(); ++i) {
        const Tensor g = torch::randn(pr[i].sizes(), torch::TensorOptions(kCuda));
        pr[i].mutable_grad() = g;
        // Even steps: channels_last grads (what autograd gives); odd: contiguous ones.
        pf[i].mutable_grad() = s % 2 == 0 ? g.contiguous(cl) : g.clone();
      }
      ref->step();
      fused->step();
    }
    EXPECT_LT(max_rel_diff(pf, pr), 2e-5) << (sgd ? "sgd" : "adamw");
    EXPECT_EQ(pf[0].data_ptr(), before) << "the parameter was replaced, not updated in place";
    EXPECT_TRUE(pf[0].is_contiguous(cl));
    auto [found, norm] = strobe::ops::nonfinite_check(std::vector<Tensor>{pf[0].grad(), pf[1].grad()}, true);
    EXPECT_EQ(found.item<float>(), 0.f);
  }
}

TEST(FusedOptimizersCuda, MisalignedViewsAndGradMultiplierAreHandled) {
  SKIP_WITHOUT_CUDA();
  // Parameters that are views at odd offsets of one flat buffer (no 16-byte alignment).
  Tensor flat_r = torch::randn({10001}, torch::TensorOptions(kCuda));
  Tensor flat_f = flat_r.clone();
  std::vector<Tensor> pr, pf;
  for (int64_t begin : {1, 1000, 5003}) {
    pr.push_back(flat_r.slice(0, begin, begin + 997).detach().requires_grad_(true));
    pf.push_back(flat_f.slice(0, begin, begin + 997).detach().requires_grad_(true));
  }
  torch::optim::AdamW ref(pr, torch::optim::AdamWOptions(1e-2));
  strobe::ops::FusedAdamW fused(pf, torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < 50; ++s) {
    for (size_t i = 0; i < pr.size(); ++i) {
      const Tensor g = torch::randn({997}, torch::TensorOptions(kCuda));
      pr[i].mutable_grad() = g * 0.5;
      pf[i].mutable_grad() = g.clone();
    }
    fused.set_grad_multiplier(torch::full({}, 0.5f, torch::TensorOptions(kCuda)));
    ref.step();
    fused.step();
  }
  EXPECT_LT(max_rel_diff(pf, pr), 2e-5);
}

}  // namespace

TEST(FusedOptimizersCuda, DeviceLearningRateGivesBitwiseTheHostLrStep) {
  SKIP_WITHOUT_CUDA();
  strobe::testing::check_device_lr_matches_host_lr(kCuda);
}

// strobe::ema_update_ on CUDA: 600 tensors (two launches) of odd sizes, misaligned views among them,
// fp32, bf16 and fp16 sources; 20 updates with a weight that changes every update; against a float64
// reference by relative error; a non-zero skip flag leaves every average bitwise as it was; NaN
// never passes (a NaN source makes its average NaN, which the check would catch).
TEST(EmaUpdateCuda, MatchesFloat64ReferenceAndHonoursTheSkipFlag) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(11);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  std::vector<torch::Tensor> avgs, srcs, ref;
  std::vector<torch::ScalarType> dtypes = {torch::kFloat32, torch::kBFloat16, torch::kFloat16};
  for (int i = 0; i < 600; ++i) {
    const int64_t n = 1 + (i * 7919) % 40000;
    // Every fifth pair: views that start off a 16-byte boundary (the kernel's scalar path).
    const int64_t off = i % 5 == 0 ? 1 + i % 3 : 0;
    torch::Tensor a = torch::randn({n + off}, cuda).narrow(0, off, n);
    avgs.push_back(a);
    ref.push_back(a.to(torch::kFloat64));
    srcs.push_back(torch::randn({n + off}, cuda).to(dtypes[i % 3]).narrow(0, off, n));
  }
  const torch::Tensor no_skip = torch::zeros({}, cuda), skip = torch::ones({}, cuda);
  for (int k = 0; k < 20; ++k) {
    const double w = 1.0 - std::min(0.999, 1.0 - std::pow(1.0 + k, -2.0 / 3.0));
    for (auto& s : srcs) s.copy_(torch::randn(s.sizes(), cuda));
    strobe::ops::ema_update_(avgs, srcs, w, no_skip);
    for (size_t i = 0; i < avgs.size(); ++i) ref[i] += w * (srcs[i].to(torch::kFloat64) - ref[i]);
    // A skipped update changes nothing at all.
    std::vector<torch::Tensor> before;
    for (auto& a : avgs) before.push_back(a.clone());
    strobe::ops::ema_update_(avgs, srcs, 0.5, skip);
    for (size_t i = 0; i < avgs.size(); ++i) ASSERT_TRUE(torch::equal(avgs[i], before[i])) << "skipped update moved tensor " << i;
  }
  double worst = 0;
  for (size_t i = 0; i < avgs.size(); ++i) {
    const double rel = ((avgs[i].to(torch::kFloat64) - ref[i]).abs().max() / ref[i].abs().max()).item<double>();
    worst = std::max(worst, std::isnan(rel) ? INFINITY : rel);
  }
  EXPECT_LT(worst, 1e-6);
  // The CPU implementation agrees.
  std::vector<torch::Tensor> cpu_avgs, cpu_srcs;
  for (size_t i = 0; i < 10; ++i) cpu_avgs.push_back(avgs[i].cpu()), cpu_srcs.push_back(srcs[i].cpu());
  strobe::ops::ema_update_(avgs, srcs, 0.25, no_skip);
  strobe::ops::ema_update_(cpu_avgs, cpu_srcs, 0.25);
  for (size_t i = 0; i < 10; ++i) EXPECT_TRUE(torch::allclose(avgs[i].cpu(), cpu_avgs[i], 1e-6, 1e-6)) << i;
}
