#include <gtest/gtest.h>
#include <torch/torch.h>

#include "framework/tasks/giou_reference.h"

namespace strobe::tasks {
namespace {

// Scalar GIoU, written independently from the ATen reference (seed's formula, eps 1e-5).
double giou_scalar(const float* a, const float* b) {
  const double eps = 1e-5;
  double area_a = (a[2] - a[0]) * (a[3] - a[1]), area_b = (b[2] - b[0]) * (b[3] - b[1]);
  double iw = std::min(a[2], b[2]) - std::max(a[0], b[0]), ih = std::min(a[3], b[3]) - std::max(a[1], b[1]);
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
  // The seed's formula does not clamp the overlap at 0, so boxes disjoint on both axes give huge
  // values: compare relatively (fp32 vs double).
  EXPECT_NEAR(giou_loss_padded_reference(pred, target, "sum").item<double>(), sum, 1e-6 * std::abs(sum) + 1e-4);
  EXPECT_NEAR(giou_loss_padded_reference(pred, target, "mean").item<double>(), sum / valid, 1e-6 * std::abs(sum / valid) + 1e-5);
  auto none = giou_loss_padded_reference(pred, target, "none");
  EXPECT_EQ(none.sizes(), (torch::IntArrayRef{b, n}));
  EXPECT_EQ(none[0].abs().sum().item<double>(), 0.0);
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
