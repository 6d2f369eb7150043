#include "strobe/metrics/aggregation.h"

#include "strobe/metrics/registry.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <limits>

namespace strobe::metrics {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

torch::Tensor scalar_state(double value, const torch::Device& device) {
  return torch::full({}, value, torch::TensorOptions().dtype(torch::kFloat64).device(device));
}

// Values as float64 on the metric's device, with NaNs handled by the strategy; `identity` is the
// value that leaves the reduction unchanged (used by ignore).
torch::Tensor prepare(const torch::Tensor& value, NanStrategy strategy, double replacement, double identity) {
  auto v = value.detach().to(torch::kFloat64);
  if (strategy == NanStrategy::kIgnore) return v.masked_fill(v.isnan(), identity);
  if (strategy == NanStrategy::kReplace) return v.masked_fill(v.isnan(), replacement);
  return v;
}

}  // namespace

MeanMetric::MeanMetric(const MetricOptions& o)
    : Metric("mean", o.device), nan_strategy_(o.nan_strategy), nan_replacement_(o.nan_replacement) {
  sum_ = add_state("mean_value", scalar_state(0.0, o.device), Reduction::kSum);
  weight_ = add_state("weight", scalar_state(0.0, o.device), Reduction::kSum);
}

void MeanMetric::update(const torch::Tensor& value, const torch::Tensor& weight) {
  torch::NoGradGuard no_grad;
  auto v = value.detach().to(torch::kFloat64);
  auto w = weight.defined() ? weight.detach().to(torch::kFloat64).broadcast_to(v.sizes()) : torch::ones_like(v);
  std::tie(v, w) = detail::apply_nan_strategy(v, w, nan_strategy_, nan_replacement_);
  state(sum_).add_(v.mul(w).sum());
  state(weight_).add_(w.sum());
}

void MeanMetric::update(const torch::Tensor& value, double weight) {
  update(value, torch::full_like(value, weight, torch::kFloat64));
}

torch::Tensor MeanMetric::compute() const { return state(sum_).div(state(weight_)).to(torch::kFloat); }

SumMetric::SumMetric(const MetricOptions& o)
    : Metric("sum", o.device), nan_strategy_(o.nan_strategy), nan_replacement_(o.nan_replacement) {
  sum_ = add_state("sum_value", scalar_state(0.0, o.device), Reduction::kSum);
}

void SumMetric::update(const torch::Tensor& value, const torch::Tensor&) {
  torch::NoGradGuard no_grad;
  state(sum_).add_(prepare(value, nan_strategy_, nan_replacement_, 0.0).sum());
}

torch::Tensor SumMetric::compute() const { return state(sum_).to(torch::kFloat); }

MaxMetric::MaxMetric(const MetricOptions& o)
    : Metric("max", o.device), nan_strategy_(o.nan_strategy), nan_replacement_(o.nan_replacement) {
  max_ = add_state("max_value", scalar_state(-kInf, o.device), Reduction::kMax);
}

void MaxMetric::update(const torch::Tensor& value, const torch::Tensor&) {
  if (value.numel() == 0) return;  // shape, not value: known on the host
  torch::NoGradGuard no_grad;
  // amax and maximum both propagate NaN, which is what "propagate" asks for.
  auto m = prepare(value, nan_strategy_, nan_replacement_, -kInf).amax();
  torch::maximum_out(state(max_), state(max_), m);
}

torch::Tensor MaxMetric::compute() const { return state(max_).to(torch::kFloat); }

MinMetric::MinMetric(const MetricOptions& o)
    : Metric("min", o.device), nan_strategy_(o.nan_strategy), nan_replacement_(o.nan_replacement) {
  min_ = add_state("min_value", scalar_state(kInf, o.device), Reduction::kMin);
}

void MinMetric::update(const torch::Tensor& value, const torch::Tensor&) {
  if (value.numel() == 0) return;
  torch::NoGradGuard no_grad;
  auto m = prepare(value, nan_strategy_, nan_replacement_, kInf).amin();
  torch::minimum_out(state(min_), state(min_), m);
}

torch::Tensor MinMetric::compute() const { return state(min_).to(torch::kFloat); }

CatMetric::CatMetric(const MetricOptions& o)
    : Metric("cat", o.device),
      nan_strategy_(o.nan_strategy),
      nan_replacement_(o.nan_replacement),
      capacity_(o.capacity) {
  TORCH_CHECK(capacity_ > 0, "CatMetric needs a capacity > 0 (MetricOptions::capacity)");
  auto f = torch::TensorOptions().dtype(torch::kFloat).device(o.device);
  buffer_ = add_state("values", torch::full({capacity_ + 1}, std::numeric_limits<double>::quiet_NaN(), f),
                      Reduction::kCat);
  count_ = add_state("count", torch::zeros({}, f.dtype(torch::kLong)), Reduction::kCat);
}

void CatMetric::update(const torch::Tensor& value, const torch::Tensor&) {
  const int64_t n = value.numel();
  if (n == 0) return;
  torch::NoGradGuard no_grad;
  auto v = value.detach().reshape({-1}).to(state(buffer_).dtype());
  auto& count = state(count_);
  torch::Tensor pos;
  if (nan_strategy_ == NanStrategy::kIgnore) {
    // Compaction without a data-dependent shape: kept values get consecutive positions, the others
    // are written to the spare slot at index `capacity`.
    auto keep = v.isnan().logical_not();
    auto keep_long = keep.to(torch::kLong);
    pos = keep_long.cumsum(0).sub_(1).add_(count).masked_fill_(keep.logical_not(), capacity_);
    count.add_(keep_long.sum());
  } else {
    if (nan_strategy_ == NanStrategy::kReplace) v = v.masked_fill(v.isnan(), nan_replacement_);
    pos = torch::arange(n, count.options()).add_(count);
    count.add_(n);
  }
  state(buffer_).scatter_(0, pos.clamp_max_(capacity_), v);
}

torch::Tensor CatMetric::compute() const {
  const auto& buf = state(buffer_);
  auto slots = torch::arange(capacity_, state(count_).options());
  return buf.slice(0, 0, capacity_).masked_fill(slots >= state(count_), std::numeric_limits<double>::quiet_NaN());
}

torch::Tensor CatMetric::values() const {
  const int64_t stored = std::min<int64_t>(state(count_).item<int64_t>(), capacity_);
  return state(buffer_).slice(0, 0, stored).clone();
}

void CatMetric::sync(c10d::ProcessGroup& group) {
  begin_sync();
  const int world = group.getSize();
  auto& buf = state(buffer_);
  auto& count = state(count_);
  std::vector<std::vector<torch::Tensor>> bufs(1), counts(1);
  for (int r = 0; r < world; ++r) {
    bufs[0].push_back(torch::empty_like(buf));
    counts[0].push_back(torch::empty({1}, count.options()));
  }
  std::vector<torch::Tensor> buf_in{buf}, count_in{count.view({1})};
  auto w1 = group.allgather(bufs, buf_in);
  auto w2 = group.allgather(counts, count_in);
  w1->wait();
  w2->wait();
  // Merge on the device: rank r's stored values go after the stored values of ranks < r.
  auto merged = torch::full_like(buf, std::numeric_limits<double>::quiet_NaN());
  auto offset = torch::zeros({}, count.options());
  auto total = torch::zeros({}, count.options());
  auto slots = torch::arange(capacity_, count.options());
  for (int r = 0; r < world; ++r) {
    auto c = counts[0][r].select(0, 0);
    auto stored = c.clamp_max(capacity_);
    auto pos = slots.add(offset).masked_fill_(slots >= stored, capacity_).clamp_max_(capacity_);
    merged.scatter_(0, pos, bufs[0][r].slice(0, 0, capacity_));
    offset.add_(stored);
    total.add_(c);
  }
  buf.copy_(merged);
  count.copy_(total);
}

STROBE_REGISTER(metric_registry(), "mean", metric_factory<MeanMetric>());
STROBE_REGISTER(metric_registry(), "sum", metric_factory<SumMetric>());
STROBE_REGISTER(metric_registry(), "min", metric_factory<MinMetric>());
STROBE_REGISTER(metric_registry(), "max", metric_factory<MaxMetric>());
STROBE_REGISTER(metric_registry(), "cat", metric_factory<CatMetric>());

}  // namespace strobe::metrics
