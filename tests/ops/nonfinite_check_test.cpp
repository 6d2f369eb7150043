// strobe::nonfinite_check on CPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "strobe/ops/ops.h"

namespace {

using torch::Tensor;

std::vector<Tensor> mixed_list() {
  torch::manual_seed(3);
  return {torch::randn({17}), torch::randn({4, 33}).to(torch::kBFloat16),
          torch::randn({5}).to(torch::kHalf), torch::randn({2, 3}, torch::kDouble),
          torch::empty({0})};
}

double norm_of(const std::vector<Tensor>& ts) {
  double s = 0;
  for (const Tensor& t : ts) s += t.to(torch::kDouble).square().sum().item<double>();
  return std::sqrt(s);
}

TEST(NonfiniteCheck, FiniteListGivesZeroFlagAndTheTotalNorm) {
  const auto ts = mixed_list();
  auto [found, norm] = strobe::ops::nonfinite_check(ts, true);
  EXPECT_EQ(found.scalar_type(), torch::kFloat);
  EXPECT_EQ(found.dim(), 0);
  EXPECT_EQ(found.item<float>(), 0.f);
  EXPECT_NEAR(norm.item<double>(), norm_of(ts), 1e-5 * norm_of(ts));
}

TEST(NonfiniteCheck, AnyNaNOrInfInAnyTensorSetsTheFlag) {
  for (double bad : {double(NAN), double(INFINITY), -double(INFINITY)}) {
    for (size_t which = 0; which < 4; ++which) {
      auto ts = mixed_list();
      ts[which].view({-1})[ts[which].numel() - 1] = bad;
      auto [found, norm] = strobe::ops::nonfinite_check(ts, false);
      EXPECT_EQ(found.item<float>(), 1.f) << bad << " in tensor " << which;
      EXPECT_FALSE(norm.defined());
    }
  }
}

TEST(NonfiniteCheck, EmptyListIsFinite) {
  auto [found, norm] = strobe::ops::nonfinite_check({}, true);
  EXPECT_EQ(found.item<float>(), 0.f);
  EXPECT_EQ(norm.item<float>(), 0.f);
}

TEST(NonfiniteCheck, RejectsIntegerTensors) {
  EXPECT_THROW(strobe::ops::nonfinite_check({torch::ones({3}), torch::ones({2}, torch::kInt)}),
               c10::Error);
  EXPECT_THROW(strobe::ops::nonfinite_check({Tensor()}), c10::Error);
}

}  // namespace
