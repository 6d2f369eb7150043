#include "strobe/metrics/language.h"

#include "strobe/metrics/registry.h"

namespace strobe::metrics {

Perplexity::Perplexity(const MetricOptions& o)
    : Metric("perplexity", o.device),
      ignore_index_(o.ignore_index),
      nan_strategy_(o.nan_strategy),
      nan_replacement_(o.nan_replacement) {
  auto d = torch::TensorOptions().dtype(torch::kFloat64).device(o.device);
  nll_sum_ = add_state("nll_sum", torch::zeros({}, d), Reduction::kSum);
  count_ = add_state("count", torch::zeros({}, d.dtype(torch::kLong)), Reduction::kSum);
}

void Perplexity::update(const torch::Tensor& logits, const torch::Tensor& target) {
  TORCH_CHECK(logits.dim() == target.dim() + 1 && logits.sizes().slice(0, target.dim()) == target.sizes(), name(),
              ": logits must be [..., V] over target [...], got ", logits.sizes(), " and ", target.sizes());
  torch::NoGradGuard no_grad;
  const int64_t v = logits.size(-1);
  auto t = target.detach().to(torch::kLong);
  auto valid = t.ge(0).logical_and_(t.lt(v));
  if (ignore_index_) valid.logical_and_(t.ne(*ignore_index_));
  auto logp = torch::log_softmax(logits.detach(), -1, torch::kFloat);
  auto nll = logp.gather(-1, t.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1).neg().to(torch::kFloat64);
  if (nan_strategy_ == NanStrategy::kIgnore) valid.logical_and_(nll.isnan().logical_not());
  if (nan_strategy_ == NanStrategy::kReplace) nll = nll.masked_fill(nll.isnan(), nan_replacement_);
  state(nll_sum_).add_(nll.masked_fill(valid.logical_not(), 0.0).sum());
  state(count_).add_(valid.sum());
}

torch::Tensor Perplexity::compute() const {
  return state(nll_sum_).div(state(count_)).exp().to(torch::kFloat);
}

TokenAccuracy::TokenAccuracy(const MetricOptions& o)
    : Metric("token_accuracy", o.device),
      top_k_(o.top_k),
      ignore_index_(o.ignore_index),
      nan_strategy_(o.nan_strategy),
      nan_replacement_(o.nan_replacement) {
  TORCH_CHECK(top_k_ >= 1, "token_accuracy: top_k must be >= 1");
  auto d = torch::TensorOptions().dtype(torch::kLong).device(o.device);
  correct_ = add_state("correct", torch::zeros({}, d), Reduction::kSum);
  total_ = add_state("total", torch::zeros({}, d), Reduction::kSum);
}

void TokenAccuracy::update(const torch::Tensor& logits, const torch::Tensor& target) {
  torch::NoGradGuard no_grad;
  auto t = target.detach().to(torch::kLong);
  auto valid = t.ge(0);
  if (ignore_index_) valid.logical_and_(t.ne(*ignore_index_));
  torch::Tensor hit;
  if (logits.dim() == target.dim() + 1) {
    TORCH_CHECK(logits.sizes().slice(0, target.dim()) == target.sizes(), name(), ": logits ", logits.sizes(),
                " do not match target ", target.sizes());
    valid.logical_and_(t.lt(logits.size(-1)));
    auto s = logits.detach();
    if (nan_strategy_ == NanStrategy::kIgnore) valid.logical_and_(s.isnan().any(-1).logical_not());
    if (nan_strategy_ == NanStrategy::kReplace) s = s.masked_fill(s.isnan(), nan_replacement_);
    if (top_k_ == 1) {
      hit = s.argmax(-1).eq(t);
    } else {
      hit = std::get<1>(s.topk(top_k_, -1)).eq(t.unsqueeze(-1)).any(-1);
    }
  } else {
    TORCH_CHECK(logits.sizes() == target.sizes() && top_k_ == 1, name(),
                ": expected logits [..., V] or predicted ids of the target's shape (top_k 1), got ", logits.sizes(),
                " and ", target.sizes());
    hit = logits.detach().to(torch::kLong).eq(t);
  }
  state(correct_).add_(hit.logical_and_(valid).sum());
  state(total_).add_(valid.sum());
}

torch::Tensor TokenAccuracy::compute() const {
  return detail::safe_divide(state(correct_), state(total_)).to(torch::kFloat);
}

STROBE_REGISTER(metric_registry(), "perplexity", metric_factory<Perplexity>());
STROBE_REGISTER(metric_registry(), "token_accuracy", metric_factory<TokenAccuracy>());

}  // namespace strobe::metrics
