// strobe::giou_loss on CPU against the baseline's loss_with_padding (bench/pytorch_baselines.py)
// with the standard GIoU (intersection sides clamped at 0, as torchvision's generalized_box_iou),
// differentiated by autograd in float64.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/ops/op_test_util.h"

namespace {

using torch::Tensor;
namespace idx = torch::indexing;

// generalized_box_iou(boxes1, boxes2) of bench/pytorch_baselines.py in ATen, with the standard
// clamp of the intersection sides at 0 (the seed does not clamp; clamp = false gives its
// formula, used only to show that the seed diverges where the op does not).
Tensor generalized_box_iou(const Tensor& b1, const Tensor& b2, bool clamp = true) {
  const double eps = 1e-5;
  auto c = [](const Tensor& b, int64_t k) { return b.index({idx::Ellipsis, k}); };
  auto s = [](const Tensor& b, int64_t lo, int64_t hi) {
    return b.index({idx::Ellipsis, idx::Slice(lo, hi)});
  };
  const Tensor area1 = (c(b1, 2) - c(b1, 0)) * (c(b1, 3) - c(b1, 1));
  const Tensor area2 = (c(b2, 2) - c(b2, 0)) * (c(b2, 3) - c(b2, 1));
  const Tensor lt = torch::max(s(b1, 0, 2), s(b2, 0, 2)), rb = torch::min(s(b1, 2, 4), s(b2, 2, 4));
  const Tensor wh = clamp ? (rb - lt).clamp_min(0) : rb - lt;
  const Tensor inter = c(wh, 0) * c(wh, 1);
  const Tensor uni = area1 + area2 - inter;
  const Tensor iou = inter / uni.clamp(eps);
  const Tensor lti = torch::min(s(b1, 0, 2), s(b2, 0, 2)), rbi = torch::max(s(b1, 2, 4), s(b2, 2, 4));
  const Tensor whi = rbi - lti;
  const Tensor areai = (c(whi, 0) * c(whi, 1)).clamp(eps);
  return iou - (areai - uni) / areai;
}

Tensor loss_with_padding(const Tensor& pred, const Tensor& targets) {
  const Tensor mask = (targets.index({idx::Ellipsis, 3}) > 0).to(pred.scalar_type());
  const Tensor loss = generalized_box_iou(targets, pred) * mask;
  return loss.sum() / torch::clamp(mask.sum(), 1);
}

// make_boxes of the baseline: few valid targets per image, zero padding, predictions nearby.
std::pair<Tensor, Tensor> make_boxes(int64_t b, int64_t n, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  const Tensor count = torch::clamp(torch::floor(torch::abs(torch::randn({b}, g) * 3)), 0, n).to(torch::kLong);
  const Tensor tl = torch::randint(0, 255, {b, n, 2}, g);
  const Tensor sz = torch::randint(1, 256, {b, n, 2}, g);
  const Tensor br = torch::clamp(tl + sz, 0, 255);
  const Tensor valid = torch::arange(n).unsqueeze(0) < count.unsqueeze(1);
  const Tensor t = torch::cat({tl, br}, -1).to(torch::kFloat) * valid.unsqueeze(-1);
  const Tensor ptl = torch::rand({b, n, 2}, g) * 200;
  const Tensor p = torch::cat({ptl, ptl + 1 + torch::rand({b, n, 2}, g) * 50}, -1);
  return {p, t};
}

using strobe::testing::rel_err;

struct Result {
  Tensor loss, grad;
};

Result run_op(const Tensor& pred, const Tensor& target, const std::string& reduction) {
  Tensor p = pred.detach().clone().requires_grad_(true);
  Tensor loss = strobe::ops::giou_loss(p, target, reduction);
  Tensor seed = reduction == "none"
                    ? torch::linspace(-1, 1, loss.numel(), torch::kDouble).reshape(loss.sizes())
                    : torch::ones({}, torch::kDouble);
  loss.backward(seed.to(loss.scalar_type()));
  return {loss.detach(), p.grad()};
}

Result run_reference(const Tensor& pred, const Tensor& target, const std::string& reduction) {
  Tensor p = pred.detach().to(torch::kDouble).requires_grad_(true);
  const Tensor t = target.to(torch::kDouble);
  Tensor loss;
  if (reduction == "mean") {
    loss = loss_with_padding(p, t);
  } else {
    const Tensor mask = (t.index({idx::Ellipsis, 3}) > 0).to(torch::kDouble);
    loss = generalized_box_iou(t, p) * mask;
    if (reduction == "sum") loss = loss.sum();
  }
  Tensor seed = reduction == "none" ? torch::linspace(-1, 1, loss.numel(), torch::kDouble).reshape(loss.sizes())
                                    : torch::ones({}, torch::kDouble);
  loss.backward(seed);
  return {loss.detach(), p.grad()};
}

TEST(GiouLoss, MeanMatchesBaselineLossWithPaddingAndAutogradInFloat64) {
  for (int64_t n : {1, 7, 256, 1000}) {
    for (int64_t b : {1, 3}) {
      auto [p, t] = make_boxes(b, n, 100 * n + b);
      const Result got = run_op(p.to(torch::kDouble), t, "mean");
      const Result want = run_reference(p, t, "mean");
      EXPECT_LT(rel_err(got.loss, want.loss), 1e-12) << "B=" << b << " N=" << n;
      EXPECT_LT(rel_err(got.grad, want.grad), 1e-12) << "B=" << b << " N=" << n;
    }
  }
}

TEST(GiouLoss, Float32AndHalfPredictionsStayWithinTheirErrorBounds) {
  auto [p, t] = make_boxes(64, 256, 7);
  // Mostly valid rows, so the comparison is not dominated by padding.
  t = torch::where(t.index({idx::Ellipsis, 3}).unsqueeze(-1) > 0, t,
                   torch::tensor({10.f, 20.f, 90.f, 120.f}));
  const Result want = run_reference(p, t, "mean");
  const struct {
    torch::Dtype dtype;
    double bound;
  } cases[] = {{torch::kFloat, 1e-5}, {torch::kBFloat16, 1e-2}, {torch::kHalf, 1e-2}};
  for (const auto& c : cases) {
    const Tensor pc = p.to(c.dtype);
    const Result ref = run_reference(pc, t, "mean");  // the reference sees the rounded inputs
    const Result got = run_op(pc, t, "mean");
    EXPECT_EQ(got.loss.scalar_type(), torch::kFloat);
    EXPECT_EQ(got.grad.scalar_type(), c.dtype);
    EXPECT_LT(rel_err(got.loss, ref.loss), c.bound) << c.dtype;
    // The gradient has pred's dtype: compare with the reference rounded to it (fp16 mean-reduced
    // gradients of ~16k boxes are ~1e-7, fp16 subnormals, so the rounding is not negligible).
    EXPECT_LT(rel_err(got.grad, ref.grad.to(c.dtype)), c.bound) << c.dtype;
  }
}

TEST(GiouLoss, SumAndNoneReductionsMatchTheMaskedReference) {
  auto [p, t] = make_boxes(5, 40, 11);
  for (const std::string r : {"sum", "none"}) {
    const Result got = run_op(p.to(torch::kDouble), t, r);
    const Result want = run_reference(p, t, r);
    ASSERT_EQ(got.loss.sizes(), want.loss.sizes()) << r;
    EXPECT_LT(rel_err(got.loss, want.loss), 1e-12) << r;
    EXPECT_LT(rel_err(got.grad, want.grad), 1e-12) << r;
  }
}

TEST(GiouLoss, DegenerateBoxesGiveTheReferenceGradientWithoutNaN) {
  // Identical boxes (ties in every max/min), zero-area boxes, disjoint boxes, touching edges.
  const Tensor t = torch::tensor({{{10., 10., 20., 20.}, {5., 5., 5., 9.}, {0., 0., 4., 4.},
                                   {0., 0., 10., 10.}, {3., 3., 3., 3.}, {1., 1., 2., 2.}}});
  const Tensor p = torch::tensor({{{10., 10., 20., 20.}, {5., 5., 5., 9.}, {50., 60., 70., 80.},
                                   {10., 0., 20., 10.}, {3., 3., 3., 3.}, {2., 1., 2., 2.}}},
                                 torch::kDouble);
  const Result got = run_op(p, t, "none");
  const Result want = run_reference(p, t, "none");
  EXPECT_FALSE(torch::isnan(got.loss).any().item<bool>());
  EXPECT_FALSE(torch::isnan(got.grad).any().item<bool>());
  EXPECT_LT(rel_err(got.loss, want.loss), 1e-12);
  EXPECT_LT(rel_err(got.grad, want.grad), 1e-12);
}

TEST(GiouLoss, BoxesDisjointOnBothAxesGiveAFiniteLossAndGradient) {
  // Predictions disjoint from their targets on both axes, some barely (overlap sides of -1e-3, the
  // seed's formula then has a union below eps), some far. Without the clamp the seed's
  // "intersection" is the positive product of two negative sides and its GIoU leaves [-1, 1].
  const Tensor t = torch::tensor({{{0., 0., 1e-3, 1e-3}, {0., 0., 10., 10.}, {100., 100., 110., 120.},
                                   {0., 0., 4., 4.}, {50., 50., 51., 51.}}});
  const Tensor p = torch::tensor({{{2e-3, 2e-3, 3e-3, 3e-3}, {20., 30., 25., 31.}, {0., 0., 90., 95.},
                                   {4.5, 4.5, 5., 5.}, {51.001, 51.001, 51.002, 51.002}}},
                                 torch::kDouble);
  // The seed's formula is not bounded here: the test would fail without the clamp.
  const Tensor seed = generalized_box_iou(t, p, /*clamp=*/false);
  EXPECT_FALSE(((seed >= -1) & (seed <= 1)).all().item<bool>()) << seed;
  for (const torch::Dtype dtype : {torch::kDouble, torch::kFloat}) {
    const Tensor pc = p.to(dtype);
    const Result got = run_op(pc, t, "none");
    const Result want = run_reference(pc, t, "none");
    EXPECT_TRUE(torch::isfinite(got.loss).all().item<bool>()) << got.loss;
    EXPECT_TRUE(torch::isfinite(got.grad).all().item<bool>()) << got.grad;
    EXPECT_TRUE(((got.loss >= -1) & (got.loss <= 1)).all().item<bool>()) << got.loss;
    EXPECT_TRUE((got.loss < 0).all().item<bool>()) << got.loss;  // no overlap: GIoU = -(C - U) / C
    EXPECT_LT(rel_err(got.loss, want.loss), dtype == torch::kDouble ? 1e-12 : 1e-5);
    EXPECT_LT(rel_err(got.grad, want.grad), dtype == torch::kDouble ? 1e-12 : 1e-5);
    const Result mean = run_op(pc, t, "mean");
    EXPECT_TRUE(std::isfinite(mean.loss.item<double>()));
    EXPECT_GE(mean.loss.item<double>(), -1.0);
    EXPECT_LE(mean.loss.item<double>(), 1.0);
    EXPECT_TRUE(torch::isfinite(mean.grad).all().item<bool>());
  }
}

TEST(GiouLoss, NegativeOverlapSidesPassNoGradientThroughTheIntersection) {
  // Disjoint in x only (w < 0, h > 0): the clamped intersection is 0 and constant in the
  // prediction's x sides, so their gradient comes only from area(pred) and the enclosing box.
  const Tensor t = torch::tensor({{{0., 0., 10., 10.}, {0., 0., 10., 10.}}});
  const Tensor p = torch::tensor({{{12., 2., 20., 8.}, {10., 2., 20., 8.}}}, torch::kDouble);  // w = -2, w = 0
  const Result got = run_op(p, t, "none");
  const Result want = run_reference(p, t, "none");
  EXPECT_LT(rel_err(got.loss, want.loss), 1e-12);
  EXPECT_LT(rel_err(got.grad, want.grad), 1e-12);
}

TEST(GiouLoss, InvalidBoxesContributeNothingEvenWhenPredictionsAreNaN) {
  auto [p, t] = make_boxes(3, 16, 5);
  t.index_put_({0}, 0.0);  // an empty image
  const Tensor invalid = (t.index({idx::Ellipsis, 3}) <= 0).unsqueeze(-1).expand_as(p);
  const Tensor pn = torch::where(invalid, torch::full_like(p, NAN), p);
  const Result got = run_op(pn, t, "mean");
  const Result want = run_reference(p, t, "mean");
  EXPECT_LT(rel_err(got.loss, want.loss), 1e-6);
  EXPECT_TRUE(torch::isfinite(got.grad).all().item<bool>());
  EXPECT_EQ(got.grad.masked_select(invalid).abs().max().item<float>(), 0.f);
}

TEST(GiouLoss, AllInvalidBatchHasZeroLossAndZeroGradient) {
  const Tensor p = torch::rand({4, 9, 4}) * 100;
  const Tensor t = torch::zeros({4, 9, 4});
  for (const std::string r : {"mean", "sum"}) {
    const Result got = run_op(p, t, r);
    EXPECT_EQ(got.loss.item<float>(), 0.f) << r;
    EXPECT_EQ(got.grad.abs().max().item<float>(), 0.f) << r;
  }
  const Result none = run_op(p, t, "none");
  EXPECT_EQ(none.loss.sizes(), (std::vector<int64_t>{4, 9}));
  EXPECT_EQ(none.loss.abs().max().item<float>(), 0.f);
}

TEST(GiouLoss, PackedTargetsWithPaddedPredictionsMatchThePaddedLayout) {
  auto [p, t] = make_boxes(6, 12, 21);
  const Tensor counts = (t.index({idx::Ellipsis, 3}) > 0).sum(1);
  std::vector<Tensor> rows;
  std::vector<int64_t> offsets{0};
  for (int64_t i = 0; i < 6; ++i) {
    const int64_t k = counts[i].item<int64_t>();
    rows.push_back(t[i].slice(0, 0, k));
    offsets.push_back(offsets.back() + k);
  }
  const Tensor packed = torch::cat(rows);
  const Tensor off = torch::tensor(offsets, torch::kLong);
  for (const std::string r : {"mean", "sum", "none"}) {
    Tensor a = p.clone().requires_grad_(true), b = p.clone().requires_grad_(true);
    Tensor la = strobe::ops::giou_loss_packed(a, packed, off, r);
    Tensor lb = strobe::ops::giou_loss(b, t, r);
    ASSERT_EQ(la.sizes(), lb.sizes()) << r;
    EXPECT_TRUE(torch::allclose(la, lb)) << r;
    la.sum().backward();
    lb.sum().backward();
    EXPECT_TRUE(torch::allclose(a.grad(), b.grad())) << r;
  }
}

TEST(GiouLoss, FullyPackedMatchesTheConcatVariant) {
  auto [p, t] = make_boxes(1, 50, 3);
  const Tensor pp = p[0].to(torch::kDouble), tt = (t[0] + torch::tensor({0., 0., 1., 1.}));
  const Tensor off = torch::tensor({int64_t{0}, int64_t{20}, int64_t{50}});
  Tensor a = pp.clone().requires_grad_(true);
  Tensor la = strobe::ops::giou_loss_packed(a, tt, off, "mean");
  la.backward();
  Tensor b = pp.clone().requires_grad_(true);
  Tensor lb = generalized_box_iou(tt.to(torch::kDouble), b).sum() / 50;  // loss_with_concat
  lb.backward();
  EXPECT_LT(rel_err(la, lb), 1e-12);
  EXPECT_LT(rel_err(a.grad(), b.grad()), 1e-12);
}

TEST(GiouLoss, WithoutGradTheForwardStillComputesTheLoss) {
  auto [p, t] = make_boxes(2, 8, 9);
  torch::NoGradGuard no_grad;
  const Tensor l = strobe::ops::giou_loss(p, t);
  EXPECT_LT(rel_err(l, loss_with_padding(p.to(torch::kDouble), t.to(torch::kDouble))), 1e-6);
}

TEST(GiouLoss, RejectsBadArguments) {
  const Tensor p = torch::rand({2, 3, 4}), t = torch::rand({2, 3, 4});
  EXPECT_THROW(strobe::ops::giou_loss(p, t, "avg"), c10::Error);
  EXPECT_THROW(strobe::ops::giou_loss(p, torch::rand({2, 4, 4})), c10::Error);
  EXPECT_THROW(strobe::ops::giou_loss(torch::rand({2, 3, 3}), torch::rand({2, 3, 3})), c10::Error);
  EXPECT_THROW(strobe::ops::giou_loss(p.reshape({6, 4}), t.reshape({6, 4})), c10::Error);
  EXPECT_THROW(strobe::ops::giou_loss(p.to(torch::kInt), t), c10::Error);
  EXPECT_THROW(strobe::ops::giou_loss(p, t.to(torch::kLong)), c10::Error);
  EXPECT_THROW(strobe::ops::giou_loss(p, t.clone().requires_grad_(true)), c10::Error);
  const Tensor packed = torch::rand({5, 4});
  auto off = [](std::vector<int64_t> v) { return torch::tensor(v, torch::kLong); };
  EXPECT_THROW(strobe::ops::giou_loss_packed(p, packed, off({0, 2, 5, 5})), c10::Error);  // B
  EXPECT_THROW(strobe::ops::giou_loss_packed(p, packed, off({0, 2})), c10::Error);  // last != T
  EXPECT_THROW(strobe::ops::giou_loss_packed(p, packed, off({0, 4, 5})), c10::Error);  // 4 > N
  EXPECT_THROW(strobe::ops::giou_loss_packed(p, packed, off({1, 2, 5})), c10::Error);  // first
  EXPECT_THROW(strobe::ops::giou_loss_packed(p, packed, off({0, 3, 2})), c10::Error);  // order
  EXPECT_THROW(strobe::ops::giou_loss_packed(p, packed, torch::tensor({0, 2, 5}, torch::kInt)), c10::Error);
  EXPECT_THROW(strobe::ops::giou_loss_packed(torch::rand({4, 4}), packed, off({0, 5})), c10::Error);
  EXPECT_NO_THROW(strobe::ops::giou_loss_packed(p, packed, off({0, 2, 5})));
}

}  // namespace
