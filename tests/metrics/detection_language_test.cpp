#include "strobe/metrics/detection.h"
#include "strobe/metrics/language.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace sm = strobe::metrics;

TEST(MeanIoU, AveragesMatchedPairsWithValidTargetsOnly) {
  // Batch of 1 image with 3 box slots; the third target is padding (y2 = 0).
  auto pred = torch::tensor({{{0.0, 0.0, 2.0, 2.0}, {0.0, 0.0, 1.0, 1.0}, {5.0, 5.0, 6.0, 6.0}}});
  auto target = torch::tensor({{{1.0, 1.0, 3.0, 3.0}, {0.0, 0.0, 1.0, 1.0}, {0.0, 0.0, 0.0, 0.0}}});
  sm::MeanIoU iou;
  iou.update(pred, target);
  // Pair 0: inter 1, union 7 -> 1/7; pair 1: 1.
  EXPECT_NEAR(iou.compute().item<float>(), (1.0 / 7 + 1.0) / 2, 1e-6);
  sm::MeanGIoU giou;
  giou.update(pred, target);
  // Pair 0: enclosing 3x3 = 9, giou = 1/7 - (9 - 7) / 9.
  EXPECT_NEAR(giou.compute().item<float>(), ((1.0 / 7 - 2.0 / 9) + 1.0) / 2, 1e-6);
}

TEST(MeanIoU, NoValidTargetGivesZero) {
  sm::MeanIoU iou;
  iou.update(torch::rand({2, 4, 4}), torch::zeros({2, 4, 4}));
  EXPECT_EQ(iou.compute().item<float>(), 0.0f);
}

TEST(MeanIoU, NanStrategyOnlySeesValidPairs) {
  // A valid but degenerate pair (zero union -> NaN) next to a good pair.
  auto pred = torch::tensor({{0.0, 1.0, 0.0, 1.0}, {0.0, 0.0, 1.0, 1.0}});
  auto target = torch::tensor({{0.0, 1.0, 0.0, 1.0}, {0.0, 0.0, 1.0, 1.0}});
  sm::MetricOptions o;
  sm::MeanIoU propagate(o);
  propagate.update(pred, target);
  EXPECT_TRUE(std::isnan(propagate.compute().item<float>()));
  o.nan_strategy = sm::NanStrategy::kIgnore;
  sm::MeanIoU ignore(o);
  ignore.update(pred, target);
  EXPECT_NEAR(ignore.compute().item<float>(), 1.0, 1e-6);
  o.nan_strategy = sm::NanStrategy::kReplace;
  sm::MeanIoU replace(o);
  replace.update(pred, target);
  EXPECT_NEAR(replace.compute().item<float>(), 0.5, 1e-6);
}

TEST(Perplexity, IsExpOfMeanTokenNllIgnoringPadding) {
  torch::manual_seed(1);
  auto logits = torch::randn({2, 5, 11});
  auto target = torch::randint(0, 11, {2, 5});
  target[1][4] = -100;
  sm::MetricOptions o;
  o.ignore_index = -100;
  sm::Perplexity ppl(o);
  ppl.update(logits.slice(0, 0, 1), target.slice(0, 0, 1));
  ppl.update(logits.slice(0, 1, 2).to(torch::kBFloat16), target.slice(0, 1, 2));
  auto logp = torch::log_softmax(logits, -1);
  double nll = 0;
  int count = 0;
  for (int b = 0; b < 2; ++b) {
    for (int s = 0; s < 5; ++s) {
      const int64_t t = target[b][s].item<int64_t>();
      if (t < 0) continue;
      const auto lp = b == 1 ? torch::log_softmax(logits[b][s].to(torch::kBFloat16), -1, torch::kFloat)
                             : logp[b][s];
      nll -= lp[t].item<double>();
      ++count;
    }
  }
  EXPECT_NEAR(ppl.compute().item<float>(), std::exp(nll / count), 1e-3);
}

TEST(TokenAccuracy, CountsNonIgnoredTokensTop1AndTopK) {
  auto logits = torch::tensor({{{0.1, 0.7, 0.2}, {0.5, 0.1, 0.4}, {0.3, 0.3, 0.4}}});
  auto target = torch::tensor({{1, 2, -100}});
  sm::MetricOptions o;
  o.ignore_index = -100;
  sm::TokenAccuracy top1(o);
  top1.update(logits, target);
  EXPECT_NEAR(top1.compute().item<float>(), 0.5, 1e-6);
  o.top_k = 2;
  sm::TokenAccuracy top2(o);
  top2.update(logits, target);
  EXPECT_NEAR(top2.compute().item<float>(), 1.0, 1e-6);
}
