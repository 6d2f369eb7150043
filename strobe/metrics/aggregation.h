#pragma once
// Aggregators: MeanMetric (weighted), SumMetric, MinMetric, MaxMetric, CatMetric (bounded).
// Values are accumulated in float64 on the metric's device; compute() returns float32.
// Conventions follow TorchMetrics' aggregation module; see docs/METRICS.md for the differences
// (NaN handling is decided on the device; CatMetric has a fixed capacity).
#include "strobe/metrics/metric.h"

namespace strobe::metrics {

// Weighted mean: sum(value * weight) / sum(weight). `weight` broadcasts to `value`; undefined
// means 1 for every element. An empty accumulation gives NaN (0 / 0), as in TorchMetrics.
class MeanMetric : public Metric {
 public:
  explicit MeanMetric(const MetricOptions& options = {});
  void update(const torch::Tensor& value, const torch::Tensor& weight = torch::Tensor()) override;
  // Scalar weight: filled on the device (no host-to-device copy).
  void update(const torch::Tensor& value, double weight);
  torch::Tensor compute() const override;

 private:
  NanStrategy nan_strategy_;
  double nan_replacement_;
  size_t sum_, weight_;
};

class SumMetric : public Metric {
 public:
  explicit SumMetric(const MetricOptions& options = {});
  void update(const torch::Tensor& value, const torch::Tensor& unused = torch::Tensor()) override;
  torch::Tensor compute() const override;

 private:
  NanStrategy nan_strategy_;
  double nan_replacement_;
  size_t sum_;
};

// MaxMetric starts at -inf and MinMetric at +inf (their value before any update).
class MaxMetric : public Metric {
 public:
  explicit MaxMetric(const MetricOptions& options = {});
  void update(const torch::Tensor& value, const torch::Tensor& unused = torch::Tensor()) override;
  torch::Tensor compute() const override;

 private:
  NanStrategy nan_strategy_;
  double nan_replacement_;
  size_t max_;
};

class MinMetric : public Metric {
 public:
  explicit MinMetric(const MetricOptions& options = {});
  void update(const torch::Tensor& value, const torch::Tensor& unused = torch::Tensor()) override;
  torch::Tensor compute() const override;

 private:
  NanStrategy nan_strategy_;
  double nan_replacement_;
  size_t min_;
};

// Concatenation of every value seen (flattened), into a device buffer of `capacity` elements and a
// device count: no shape depends on the data. Values past the capacity are counted but dropped.
// With nan_strategy ignore, NaNs are compacted out on the device (prefix-sum positions).
// compute() returns the whole buffer [capacity] (float32) with unused slots set to NaN;
// count() is the number of values offered (stored: min(count, capacity)); values() returns exactly
// the stored values and synchronizes (host-side, for epoch-end use only).
class CatMetric : public Metric {
 public:
  explicit CatMetric(const MetricOptions& options);
  void update(const torch::Tensor& value, const torch::Tensor& unused = torch::Tensor()) override;
  torch::Tensor compute() const override;
  torch::Tensor count() const { return state(count_); }
  torch::Tensor values() const;
  int64_t capacity() const { return capacity_; }
  // All-gathers every rank's stored values; rank r's values follow those of ranks < r.
  void sync(c10d::ProcessGroup& group) override;

 private:
  NanStrategy nan_strategy_;
  double nan_replacement_;
  int64_t capacity_;
  size_t buffer_, count_;  // buffer has capacity + 1 slots: the last one absorbs dropped writes
};

}  // namespace strobe::metrics
