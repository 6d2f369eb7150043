#include "strobe/metrics/aggregation.h"
#include "strobe/metrics/registry.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace sm = strobe::metrics;

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

float value_of(const torch::Tensor& t) { return t.item<float>(); }

sm::MetricOptions nan_options(sm::NanStrategy s, double replacement = 0.0) {
  sm::MetricOptions o;
  o.nan_strategy = s;
  o.nan_replacement = replacement;
  return o;
}
}  // namespace

TEST(MeanMetric, WeightedMeanOverSeveralUpdates) {
  sm::MeanMetric m;
  m.update(torch::tensor({1.0, 2.0, 3.0}), torch::tensor({1.0, 1.0, 2.0}));
  m.update(torch::tensor(4.0), 2.0);
  EXPECT_NEAR(value_of(m.compute()), (1 + 2 + 6 + 8) / 6.0, 1e-6);
  EXPECT_EQ(m.compute().scalar_type(), torch::kFloat);
  EXPECT_EQ(m.compute().dim(), 0);
}

TEST(MeanMetric, WeightBroadcastsAndDefaultsToOne) {
  sm::MeanMetric m;
  m.update(torch::tensor({{1.0, 3.0}, {5.0, 7.0}}), torch::tensor({1.0, 3.0}));
  EXPECT_NEAR(value_of(m.compute()), (1 + 9 + 5 + 21) / 8.0, 1e-6);
  sm::MeanMetric plain;
  plain.update(torch::tensor({2.0, 4.0}));
  EXPECT_NEAR(value_of(plain.compute()), 3.0, 1e-6);
}

TEST(MeanMetric, EmptyAccumulationIsNaNLikeTorchMetrics) {
  sm::MeanMetric m;
  EXPECT_TRUE(std::isnan(value_of(m.compute())));
}

TEST(MeanMetric, NanStrategiesAreAppliedOnTheDevice) {
  auto v = torch::tensor({1.0, kNaN, 3.0});
  auto w = torch::tensor({1.0, 1.0, kNaN});
  sm::MeanMetric propagate(nan_options(sm::NanStrategy::kPropagate));
  propagate.update(v, w);
  EXPECT_TRUE(std::isnan(value_of(propagate.compute())));
  sm::MeanMetric ignore(nan_options(sm::NanStrategy::kIgnore));
  ignore.update(v, w);
  EXPECT_NEAR(value_of(ignore.compute()), 1.0, 1e-6);
  // TorchMetrics: a NaN value or weight becomes (replacement, weight 1).
  sm::MeanMetric replace(nan_options(sm::NanStrategy::kReplace, 10.0));
  replace.update(v, w);
  EXPECT_NEAR(value_of(replace.compute()), (1 + 10 + 10) / 3.0, 1e-6);
}

TEST(MeanMetric, DoesNotRecordGradients) {
  auto x = torch::ones({3}, torch::requires_grad());
  sm::MeanMetric m;
  m.update(x * 2);
  EXPECT_FALSE(m.compute().requires_grad());
}

TEST(SumMinMax, AccumulateAndHandleNaN) {
  sm::SumMetric s;
  sm::MinMetric mn;
  sm::MaxMetric mx;
  EXPECT_TRUE(std::isinf(value_of(mn.compute())) && value_of(mn.compute()) > 0);
  EXPECT_TRUE(std::isinf(value_of(mx.compute())) && value_of(mx.compute()) < 0);
  for (auto* m : std::initializer_list<sm::Metric*>{&s, &mn, &mx}) {
    m->update(torch::tensor({3.0, -1.0}));
    m->update(torch::tensor({{7.0}, {2.0}}));
    m->update(torch::empty({0}));
  }
  EXPECT_NEAR(value_of(s.compute()), 11.0, 1e-6);
  EXPECT_EQ(value_of(mn.compute()), -1.0f);
  EXPECT_EQ(value_of(mx.compute()), 7.0f);

  sm::MaxMetric mx_ignore(nan_options(sm::NanStrategy::kIgnore));
  mx_ignore.update(torch::tensor({1.0, kNaN}));
  EXPECT_EQ(value_of(mx_ignore.compute()), 1.0f);
  sm::MinMetric mn_prop;
  mn_prop.update(torch::tensor({1.0, kNaN}));
  EXPECT_TRUE(std::isnan(value_of(mn_prop.compute())));
  sm::SumMetric s_replace(nan_options(sm::NanStrategy::kReplace, 5.0));
  s_replace.update(torch::tensor({1.0, kNaN}));
  EXPECT_EQ(value_of(s_replace.compute()), 6.0f);
}

TEST(CatMetric, KeepsValuesInOrderUpToCapacity) {
  sm::MetricOptions o;
  o.capacity = 5;
  sm::CatMetric c(o);
  c.update(torch::tensor({1.0, 2.0}));
  c.update(torch::tensor({{3.0}, {4.0}}));
  EXPECT_TRUE(torch::equal(c.values(), torch::tensor({1.0f, 2.0f, 3.0f, 4.0f})));
  auto all = c.compute();
  ASSERT_EQ(all.size(0), 5);
  EXPECT_TRUE(std::isnan(all[4].item<float>()));
  c.update(torch::tensor({5.0, 6.0, 7.0}));  // overflow: counted, not stored
  EXPECT_EQ(c.count().item<int64_t>(), 7);
  EXPECT_TRUE(torch::equal(c.values(), torch::tensor({1.0f, 2.0f, 3.0f, 4.0f, 5.0f})));
}

TEST(CatMetric, IgnoreCompactsNaNsWithoutDataDependentShapes) {
  sm::MetricOptions o = nan_options(sm::NanStrategy::kIgnore);
  o.capacity = 8;
  sm::CatMetric c(o);
  c.update(torch::tensor({kNaN, 1.0, kNaN, 2.0}));
  c.update(torch::tensor({3.0, kNaN}));
  EXPECT_EQ(c.count().item<int64_t>(), 3);
  EXPECT_TRUE(torch::equal(c.values(), torch::tensor({1.0f, 2.0f, 3.0f})));
}

TEST(Metric, ResetRestoresInitialState) {
  sm::MaxMetric m;
  m.update(torch::tensor({5.0}));
  m.reset();
  m.update(torch::tensor({-3.0}));
  EXPECT_EQ(value_of(m.compute()), -3.0f);
}

TEST(Registry, MakesEveryNamedMetricAndRejectsUnknownNames) {
  sm::MetricOptions o;
  o.num_classes = 4;
  o.capacity = 4;
  for (const auto& name : sm::metric_names()) {
    auto m = sm::make_metric(name, o);
    ASSERT_NE(m, nullptr) << name;
  }
  for (const char* name : {"accuracy", "precision", "recall", "f1", "mean", "sum", "min", "max", "mean_iou",
                           "mean_giou", "perplexity", "token_accuracy", "cat"}) {
    EXPECT_NO_THROW(sm::make_metric(name, o)) << name;
  }
  try {
    sm::make_metric("acuracy", o);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("accuracy"), std::string::npos);
  }
  EXPECT_EQ(sm::parse_average("weighted"), sm::Average::kWeighted);
  EXPECT_EQ(sm::parse_task("multilabel"), sm::Task::kMultilabel);
  EXPECT_EQ(sm::parse_nan_strategy("ignore"), sm::NanStrategy::kIgnore);
  EXPECT_THROW(sm::parse_average("macr"), c10::Error);
}
