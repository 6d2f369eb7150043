#include "strobe/metrics/classification.h"
#include "strobe/metrics/registry.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace sm = strobe::metrics;

namespace {
sm::MetricOptions multiclass(int64_t c, sm::Average avg, int64_t top_k = 1) {
  sm::MetricOptions o;
  o.num_classes = c;
  o.average = avg;
  o.top_k = top_k;
  return o;
}
float run(const std::string& name, const sm::MetricOptions& o, const torch::Tensor& p, const torch::Tensor& t) {
  auto m = sm::make_metric(name, o);
  m->update(p, t);
  return m->compute().item<float>();
}
// Four classes, class 3 never appears: tp = [1, 1, 2, 0], fp = [1, 1, 0, 0], fn = [1, 0, 1, 0].
const auto kPred = torch::tensor({0, 1, 1, 2, 2, 0});
const auto kTarget = torch::tensor({0, 0, 1, 2, 2, 2});
}  // namespace

TEST(Classification, ConfusionMatrixRowsAreTargetsColumnsArePredictions) {
  sm::Accuracy acc(multiclass(4, sm::Average::kMicro));
  acc.update(kPred, kTarget);
  auto expected = torch::tensor({1, 1, 0, 0, 0, 1, 0, 0, 1, 0, 2, 0, 0, 0, 0, 0}, torch::kLong).view({4, 4});
  EXPECT_TRUE(torch::equal(acc.confusion_matrix(), expected));
}

TEST(Classification, HandComputedValuesForEveryAveraging) {
  EXPECT_NEAR(run("accuracy", multiclass(4, sm::Average::kMicro), kPred, kTarget), 4.0 / 6, 1e-6);
  // Macro skips class 3 (absent from targets and predictions), as TorchMetrics does.
  EXPECT_NEAR(run("accuracy", multiclass(4, sm::Average::kMacro), kPred, kTarget), (0.5 + 1 + 2.0 / 3) / 3, 1e-6);
  EXPECT_NEAR(run("precision", multiclass(4, sm::Average::kMacro), kPred, kTarget), (0.5 + 0.5 + 1) / 3, 1e-6);
  EXPECT_NEAR(run("recall", multiclass(4, sm::Average::kWeighted), kPred, kTarget), 4.0 / 6, 1e-6);
  EXPECT_NEAR(run("f1", multiclass(4, sm::Average::kMacro), kPred, kTarget), (0.5 + 2.0 / 3 + 0.8) / 3, 1e-6);
  sm::F1Score f1(multiclass(4, sm::Average::kNone));
  f1.update(kPred, kTarget);
  EXPECT_TRUE(torch::allclose(f1.compute(), torch::tensor({0.5f, 2.0f / 3, 0.8f, 0.0f})));
}

TEST(Classification, ScoresAndLabelsGiveTheSameResult) {
  auto scores = torch::one_hot(kPred, 4).to(torch::kFloat).mul(3).add(torch::rand({6, 4}));
  EXPECT_NEAR(run("f1", multiclass(4, sm::Average::kMacro), scores, kTarget),
              run("f1", multiclass(4, sm::Average::kMacro), kPred, kTarget), 1e-6);
}

TEST(Classification, TopKCountsTargetsAmongTheKBestScores) {
  auto scores = torch::tensor({{0.5, 0.3, 0.2}, {0.1, 0.2, 0.7}, {0.6, 0.3, 0.1}});
  auto target = torch::tensor({1, 0, 2});
  EXPECT_NEAR(run("accuracy", multiclass(3, sm::Average::kMicro, 1), scores, target), 0.0, 1e-6);
  EXPECT_NEAR(run("accuracy", multiclass(3, sm::Average::kMicro, 2), scores, target), 1.0 / 3, 1e-6);
  EXPECT_NEAR(run("accuracy", multiclass(3, sm::Average::kMicro, 3), scores, target), 1.0, 1e-6);
}

TEST(Classification, IgnoreIndexAndOutOfRangeTargetsContributeNothing) {
  auto o = multiclass(3, sm::Average::kMicro);
  o.ignore_index = -100;
  auto pred = torch::tensor({0, 1, 2, 2});
  auto target = torch::tensor({0, -100, 2, 1});
  EXPECT_NEAR(run("accuracy", o, pred, target), 2.0 / 3, 1e-6);
  o.ignore_index = 1;  // inside the class range
  EXPECT_NEAR(run("accuracy", o, pred, torch::tensor({0, 1, 2, 1})), 1.0, 1e-6);
}

TEST(Classification, BinaryAppliesSigmoidOnlyToLogits) {
  sm::MetricOptions o;
  o.task = sm::Task::kBinary;
  auto target = torch::tensor({1, 0, 1, 0});
  // Probabilities: thresholded at 0.5 directly.
  EXPECT_NEAR(run("accuracy", o, torch::tensor({0.9, 0.4, 0.6, 0.7}), target), 0.75, 1e-6);
  // Logits (values outside [0, 1]): sigmoid first, so 0.3 -> 0.57 counts as positive.
  EXPECT_NEAR(run("accuracy", o, torch::tensor({2.0, -1.0, 0.3, 0.3}), target), 0.75, 1e-6);
  EXPECT_NEAR(run("precision", o, torch::tensor({1, 1, 0, 0}), target), 0.5, 1e-6);
  EXPECT_NEAR(run("recall", o, torch::tensor({1, 1, 1, 0}), target), 1.0, 1e-6);
}

TEST(Classification, MultilabelCountsPerLabel) {
  sm::MetricOptions o;
  o.task = sm::Task::kMultilabel;
  o.num_classes = 3;
  o.average = sm::Average::kMicro;
  auto preds = torch::tensor({{0.9, 0.1, 0.8}, {0.2, 0.7, 0.6}});
  auto target = torch::tensor({{1, 0, 0}, {0, 1, 1}});
  // tp = 3 (label0 s0, label1 s1, label2 s1), fp = 1 (label2 s0), tn = 2, fn = 0.
  EXPECT_NEAR(run("accuracy", o, preds, target), 5.0 / 6, 1e-6);
  EXPECT_NEAR(run("precision", o, preds, target), 3.0 / 4, 1e-6);
  EXPECT_NEAR(run("recall", o, preds, target), 1.0, 1e-6);
}

TEST(Classification, ResumeMidEpochContinuesTheSameAccumulation) {
  torch::manual_seed(0);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int i = 0; i < 10; ++i) batches.emplace_back(torch::randn({32, 7}), torch::randint(0, 7, {32}));
  auto o = multiclass(7, sm::Average::kMacro, 2);
  sm::F1Score uninterrupted(o), first_half(o), resumed(o);
  for (auto& [p, t] : batches) uninterrupted.update(p, t);
  for (int i = 0; i < 5; ++i) first_half.update(batches[i].first, batches[i].second);
  // Through a serialized checkpoint, as the trainer would save it.
  std::stringstream stream;
  std::vector<torch::Tensor> saved;
  for (auto& [k, v] : first_half.state_dict()) saved.push_back(v);
  torch::save(saved, stream);
  std::vector<torch::Tensor> loaded;
  torch::load(loaded, stream);
  std::map<std::string, torch::Tensor> state;
  size_t i = 0;
  for (auto& [k, v] : first_half.state_dict()) state[k] = loaded[i++];
  resumed.load_state_dict(state);
  for (int j = 5; j < 10; ++j) resumed.update(batches[j].first, batches[j].second);
  EXPECT_TRUE(torch::equal(resumed.confusion_matrix(), uninterrupted.confusion_matrix()));
  EXPECT_EQ(resumed.compute().item<float>(), uninterrupted.compute().item<float>());
}

TEST(Classification, LoadStateDictRejectsMismatchedShapes) {
  sm::Accuracy a(multiclass(5, sm::Average::kMacro)), b(multiclass(6, sm::Average::kMacro));
  EXPECT_THROW(b.load_state_dict(a.state_dict()), c10::Error);
}
