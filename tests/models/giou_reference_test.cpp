#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tasks/giou_reference.h"

namespace strobe::tasks {
namespace {

// Scalar GIoU, written independently from the ATen reference: standard GIoU (overlap sides
// clamped at 0, as torchvision.ops.generalized_box_iou), eps 1e-5 on union and hull as the seed.
// clamp = false is the seed's formula, used only to show that it diverges where ours does not.
double giou_scalar(const float* a, const float* b, bool clamp = true) {
  const double eps = 1e-5;
  double area_a = (a[2] - a[0]) * (a[3] - a[1]), area_b = (b[2] - b[0]) * (b[3] - b[1]);
  double iw = std::min(a[2], b[2]) - std::max(a[0], b[0]), ih = std::min(a[3], b[3]) - std::max(a[1], b[1]);
  if (clamp) iw = std::max(iw, 0.0), ih = std::max(ih, 0.0);
  double inter = iw * ih, uni = area_a + area_b - inter;
  double cw = std::max(a[2], b[2]) - std::min(a[0], b[0]), ch = std::max(a[3], b[3]) - std::min(a[1], b[1]);
  double c = std::max(cw * ch, eps);
  return inter / std::max(uni, eps) - (c - uni) / c;
}

TEST(GIoUReference, KnownValues) {
  auto same = torch::tensor({10.f, 10.f, 20.f, 20.f}).view({1, 1, 4});
  EXPECT_NEAR(giou_loss_padded_reference(same, same).item<double>(), 1.0, 1e-6);
  // Disjoint unit squares 1 apart on x: IoU 0, hull 3 x 1, union 2 -> GIoU = -(3 - 2) / 3.
  auto a = torch::tensor({0.f, 0.f, 1.f, 1.f}).view({1, 1, 4}), b = torch::tensor({2.f, 0.f, 3.f, 1.f}).view({1, 1, 4});
  EXPECT_NEAR(giou_loss_padded_reference(a, b).item<double>(), -1.0 / 3.0, 1e-6);
}

TEST(GIoUReference, MatchesAScalarImplementationOnValidRowsOnly) {
  torch::manual_seed(3);
  const int64_t b = 4, n = 16;
  auto tl = torch::rand({b, n, 2}) * 100, pred = torch::cat({tl, tl + 1 + torch::rand({b, n, 2}) * 50}, -1);
  auto ttl = torch::randint(0, 200, {b, n, 2}).to(torch::kFloat32);
  auto target = torch::cat({ttl, ttl + torch::randint(1, 50, {b, n, 2}).to(torch::kFloat32)}, -1);
  auto counts = std::vector<int64_t>{0, 1, 5, 16};
  for (int64_t i = 0; i < b; ++i) target[i].narrow(0, counts[i], n - counts[i]).zero_();
  double sum = 0;
  int64_t valid = 0;
  auto p = pred.contiguous(), t = target.contiguous();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < counts[i]; ++j, ++valid) sum += giou_scalar(t[i][j].data_ptr<float>(), p[i][j].data_ptr<float>());
  // fp32 (the reference) vs double (the scalar): compare relatively.
  EXPECT_NEAR(giou_loss_padded_reference(pred, target, "sum").item<double>(), sum, 1e-6 * std::abs(sum) + 1e-4);
  EXPECT_NEAR(giou_loss_padded_reference(pred, target, "mean").item<double>(), sum / valid, 1e-6 * std::abs(sum / valid) + 1e-5);
  auto none = giou_loss_padded_reference(pred, target, "none");
  EXPECT_EQ(none.sizes(), (torch::IntArrayRef{b, n}));
  EXPECT_EQ(none[0].abs().sum().item<double>(), 0.0);
}

TEST(GIoUReference, BoxesDisjointOnBothAxesGiveAFiniteBoundedLossAndFiniteGradients) {
  // Predictions disjoint from their targets on both axes. The seed's unclamped overlap makes the
  // "intersection" a positive product of two negative sides, the union < eps and GIoU ~ 2e7 on the
  // second row: the face detector's divergence. Standard GIoU stays in [-1, 1] (here < 0).
  auto target = torch::tensor({0.f, 0.f, 1e-3f, 1e-3f, 0.f, 0.f, 10.f, 10.f, 100.f, 100.f, 110.f, 120.f,
                               0.f, 0.f, 4.f, 4.f}).view({1, 4, 4});
  auto pred0 = torch::tensor({2e-3f, 2e-3f, 3e-3f, 3e-3f, 20.f, 30.f, 25.f, 31.f, 0.f, 0.f, 90.f, 95.f,
                              4.5f, 4.5f, 5.f, 5.f}).view({1, 4, 4});
  auto t = target.contiguous(), p0 = pred0.contiguous();
  EXPECT_GT(giou_scalar(t[0][1].data_ptr<float>(), p0[0][1].data_ptr<float>(), /*clamp=*/false), 1.0);
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    auto pred = pred0.to(dtype).clone().requires_grad_();
    auto none = giou_loss_padded_reference(pred, target.to(dtype), "none");
    ASSERT_TRUE(torch::isfinite(none).all().item<bool>()) << none;
    EXPECT_TRUE(((none >= -1) & (none < 0)).all().item<bool>()) << none;
    for (int64_t j = 0; j < 4; ++j)
      EXPECT_NEAR(none[0][j].item<double>(), giou_scalar(t[0][j].data_ptr<float>(), p0[0][j].data_ptr<float>()), 1e-5) << j;
    auto objective = giou_objective_from_mean(giou_loss_padded_reference(pred, target.to(dtype)), target);
    EXPECT_TRUE(std::isfinite(objective.item<double>()));
    EXPECT_GE(objective.item<double>(), 0.0);
    EXPECT_LE(objective.item<double>(), 2.0);
    objective.backward();
    EXPECT_TRUE(torch::isfinite(pred.grad()).all().item<bool>()) << pred.grad();
    // Gradient vs float64 autograd of the standard GIoU written out (torchvision's formula + eps).
    auto p = pred0.to(torch::kFloat64).clone().requires_grad_();
    auto tt = target.to(torch::kFloat64);
    using torch::indexing::Slice;
    auto lo = [](const torch::Tensor& x) { return x.index({0, Slice(), Slice(0, 2)}); };
    auto hi = [](const torch::Tensor& x) { return x.index({0, Slice(), Slice(2, 4)}); };
    auto area = [&](const torch::Tensor& x) { return (hi(x) - lo(x)).prod(-1); };
    auto inter = (torch::min(hi(tt), hi(p)) - torch::max(lo(tt), lo(p))).clamp_min(0).prod(-1);
    auto uni = area(tt) + area(p) - inter;
    auto hull = (torch::max(hi(tt), hi(p)) - torch::min(lo(tt), lo(p))).prod(-1).clamp_min(1e-5);
    (1.0 - (inter / uni.clamp_min(1e-5) - (hull - uni) / hull).mean()).backward();
    EXPECT_TRUE(torch::allclose(pred.grad().to(torch::kFloat64), p.grad(), 1e-5, 1e-7)) << pred.grad() << p.grad();
  }
}

TEST(GIoUReference, AllPaddingGivesZeroLossAndZeroGradient) {
  auto pred = torch::randn({2, 8, 4}, torch::requires_grad());
  auto target = torch::zeros({2, 8, 4});
  auto mean = giou_loss_padded_reference(pred, target);
  auto objective = giou_objective_from_mean(mean, target);
  EXPECT_EQ(mean.item<double>(), 0.0);
  EXPECT_EQ(objective.item<double>(), 0.0);
  objective.backward();
  EXPECT_EQ(pred.grad().abs().sum().item<double>(), 0.0);
}

TEST(GIoUReference, ObjectiveIsOneMinusMeanAndBf16IsReadInFloat) {
  auto pred = (torch::rand({1, 4, 4}) * 10).cumsum(-1).to(torch::kBFloat16).requires_grad_();
  auto target = torch::tensor({1.f, 1.f, 9.f, 9.f, 2.f, 3.f, 4.f, 8.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}).view({1, 4, 4});
  auto mean = giou_loss_padded_reference(pred, target);
  EXPECT_EQ(mean.scalar_type(), torch::kFloat32);
  auto objective = giou_objective_from_mean(mean, target);
  EXPECT_NEAR(objective.item<double>(), 1.0 - mean.item<double>(), 1e-7);
}

}  // namespace
}  // namespace strobe::tasks
