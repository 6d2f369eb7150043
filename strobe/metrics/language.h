#pragma once
// Language-model metrics. Logits are class-last, [..., V] (e.g. [B, S, V]); target is [...] with
// token ids. Tokens equal to ignore_index (e.g. padding, -100) or outside [0, V) contribute nothing.
#include "strobe/metrics/metric.h"

namespace strobe::metrics {

// exp(mean negative log-likelihood of the target tokens), accumulated as a float64 sum of NLL and
// a token count; log-softmax is taken in float32 whatever the logits' dtype. Matches TorchMetrics'
// Perplexity(ignore_index=...). nan_strategy applies to per-token NLL values.
class Perplexity : public Metric {
 public:
  explicit Perplexity(const MetricOptions& options = {});
  void update(const torch::Tensor& logits, const torch::Tensor& target) override;
  torch::Tensor compute() const override;

 private:
  std::optional<int64_t> ignore_index_;
  NanStrategy nan_strategy_;
  double nan_replacement_;
  size_t nll_sum_, count_;
};

// Fraction of non-ignored tokens whose target is the argmax (or among the top_k) of the logits;
// `logits` may also be predicted token ids of the target's shape. Equals TorchMetrics'
// MulticlassAccuracy(average="micro", top_k, ignore_index) with the class dimension moved to 1.
// nan_strategy: ignore drops tokens whose logits hold a NaN; replace fills NaN logits.
class TokenAccuracy : public Metric {
 public:
  explicit TokenAccuracy(const MetricOptions& options = {});
  void update(const torch::Tensor& logits, const torch::Tensor& target) override;
  torch::Tensor compute() const override;

 private:
  int64_t top_k_;
  std::optional<int64_t> ignore_index_;
  NanStrategy nan_strategy_;
  double nan_replacement_;
  size_t correct_, total_;
};

}  // namespace strobe::metrics
