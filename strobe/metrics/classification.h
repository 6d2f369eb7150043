#pragma once
// Classification metrics from a device-side confusion matrix: accuracy (top-1 / top-k), precision,
// recall, F-beta / F1, for multiclass (micro / macro / weighted / none), binary and multilabel
// tasks. Values and conventions follow TorchMetrics 1.x (see docs/METRICS.md):
// - multiclass preds are scores [N, C, ...] (logits or probabilities) or labels [N, ...];
//   target is [N, ...] with class indices;
// - top_k > 1 counts a sample as predicted `target` when target is among the top k scores, else as
//   predicted top-1 (TorchMetrics' refinement), so one confusion matrix serves every k;
// - macro averaging skips classes that never occur in targets or predictions (top_k = 1; with
//   top_k > 1 for accuracy/precision/recall: classes without support), as TorchMetrics does;
// - binary / multilabel float preds go through a sigmoid when any value lies outside [0, 1]
//   (decided on the device with torch::where), then `> threshold`;
// - targets equal to ignore_index or outside [0, C) contribute nothing (no host-side validation).
// State: int64 confusion matrix — multiclass [C, C] (row = target, column = prediction),
// binary [2, 2], multilabel [L, 2, 2].
#include "strobe/metrics/metric.h"

#include <array>

namespace strobe::metrics {

enum class StatKind { kAccuracy, kPrecision, kRecall, kFBeta };

class ClassificationMetric : public Metric {
 public:
  ClassificationMetric(StatKind kind, const MetricOptions& options);
  void update(const torch::Tensor& preds, const torch::Tensor& target) override;
  torch::Tensor compute() const override;

  std::string state_signature() const override;

  const torch::Tensor& confusion_matrix() const { return state(confmat_); }
  // {tp, fp, tn, fn}: per class (multiclass, multilabel) or 0-dim (binary), int64.
  std::array<torch::Tensor, 4> stat_scores() const;

 private:
  void update_multiclass(const torch::Tensor& preds, const torch::Tensor& target);
  void update_binary(const torch::Tensor& preds, const torch::Tensor& target);
  void update_multilabel(const torch::Tensor& preds, const torch::Tensor& target);

  StatKind kind_;
  MetricOptions options_;
  size_t confmat_;
};

class Accuracy : public ClassificationMetric {
 public:
  explicit Accuracy(const MetricOptions& options) : ClassificationMetric(StatKind::kAccuracy, options) {}
};

class Precision : public ClassificationMetric {
 public:
  explicit Precision(const MetricOptions& options) : ClassificationMetric(StatKind::kPrecision, options) {}
};

class Recall : public ClassificationMetric {
 public:
  explicit Recall(const MetricOptions& options) : ClassificationMetric(StatKind::kRecall, options) {}
};

// F-beta with options.beta.
class FBetaScore : public ClassificationMetric {
 public:
  explicit FBetaScore(const MetricOptions& options) : ClassificationMetric(StatKind::kFBeta, options) {}
};

// F1: F-beta with beta = 1 whatever options.beta says.
class F1Score : public ClassificationMetric {
 public:
  explicit F1Score(MetricOptions options) : ClassificationMetric(StatKind::kFBeta, with_beta_one(options)) {}

 private:
  static MetricOptions with_beta_one(MetricOptions o) {
    o.beta = 1.0;
    return o;
  }
};

}  // namespace strobe::metrics
