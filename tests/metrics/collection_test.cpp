#include "strobe/metrics/classification.h"
#include "strobe/metrics/collection.h"
#include "strobe/metrics/registry.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace sm = strobe::metrics;

namespace {
sm::MetricOptions opts(sm::Average avg, int64_t top_k = 1) {
  sm::MetricOptions o;
  o.num_classes = 9;
  o.average = avg;
  o.top_k = top_k;
  return o;
}
}  // namespace

TEST(MetricCollection, SharesOneConfusionMatrixAndMatchesStandaloneMetrics) {
  torch::manual_seed(3);
  sm::MetricCollection c;
  c.add("acc", sm::make_metric("accuracy", opts(sm::Average::kMicro)));
  c.add("prec", sm::make_metric("precision", opts(sm::Average::kMacro)));
  c.add("rec", sm::make_metric("recall", opts(sm::Average::kWeighted)));
  c.add("f1", sm::make_metric("f1", opts(sm::Average::kMacro)));
  c.add("acc_top3", sm::make_metric("accuracy", opts(sm::Average::kMicro, 3)));
  EXPECT_EQ(c.num_groups(), 2u);  // top_k changes what update() accumulates
  std::vector<std::unique_ptr<sm::Metric>> alone;
  alone.push_back(sm::make_metric("accuracy", opts(sm::Average::kMicro)));
  alone.push_back(sm::make_metric("precision", opts(sm::Average::kMacro)));
  alone.push_back(sm::make_metric("recall", opts(sm::Average::kWeighted)));
  alone.push_back(sm::make_metric("f1", opts(sm::Average::kMacro)));
  alone.push_back(sm::make_metric("accuracy", opts(sm::Average::kMicro, 3)));
  for (int i = 0; i < 4; ++i) {
    auto p = torch::randn({50, 9});
    auto t = torch::randint(0, 9, {50});
    c.update(p, t);
    for (auto& m : alone) m->update(p, t);
  }
  auto values = c.compute();
  ASSERT_EQ(values.size(), 5u);
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(values[i].second.item<float>(), alone[i]->compute().item<float>()) << values[i].first;
  }
  EXPECT_EQ(c.state_dict().size(), 2u);  // one confusion matrix per group

  sm::MetricCollection resumed;
  resumed.add("acc", sm::make_metric("accuracy", opts(sm::Average::kMicro)));
  resumed.add("prec", sm::make_metric("precision", opts(sm::Average::kMacro)));
  resumed.add("rec", sm::make_metric("recall", opts(sm::Average::kWeighted)));
  resumed.add("f1", sm::make_metric("f1", opts(sm::Average::kMacro)));
  resumed.add("acc_top3", sm::make_metric("accuracy", opts(sm::Average::kMicro, 3)));
  resumed.load_state_dict(c.state_dict());
  resumed.to(torch::kCPU);  // re-aliases the followers after moving the leaders
  auto again = resumed.compute();
  for (size_t i = 0; i < again.size(); ++i) EXPECT_EQ(again[i].second.item<float>(), values[i].second.item<float>());

  c.reset();
  EXPECT_EQ(c.at("f1").compute().item<float>(), 0.0f);
  EXPECT_THROW(c.add("f1", sm::make_metric("f1", opts(sm::Average::kMacro))), c10::Error);
  EXPECT_THROW(c.at("nope"), c10::Error);
}
