#include "strobe/metrics/classification.h"

#include "strobe/metrics/registry.h"

namespace strobe::metrics {
namespace {

const char* kind_name(StatKind kind) {
  switch (kind) {
    case StatKind::kAccuracy: return "accuracy";
    case StatKind::kPrecision: return "precision";
    case StatKind::kRecall: return "recall";
    case StatKind::kFBeta: return "fbeta";
  }
  return "?";
}

// TorchMetrics' normalize_logits_if_needed(..., "sigmoid"), decided on the device.
torch::Tensor sigmoid_if_logits(const torch::Tensor& p) {
  auto outside = p.lt(0).logical_or_(p.gt(1)).any();
  return torch::where(outside, p.sigmoid(), p);
}

// Moves the class/label dimension (1) last and flattens the rest: [N, C, ...] -> [M, C].
torch::Tensor classes_last(const torch::Tensor& t, int64_t c) {
  auto x = t.dim() > 2 ? t.movedim(1, -1) : t;
  return x.reshape({-1, c});
}

torch::Tensor ratio_for(StatKind kind, const torch::Tensor& tp, const torch::Tensor& fp, const torch::Tensor& tn,
                        const torch::Tensor& fn, bool multilabel_or_binary, double beta, double zd) {
  switch (kind) {
    case StatKind::kAccuracy:
      return multilabel_or_binary ? detail::safe_divide(tp + tn, tp + tn + fp + fn) : detail::safe_divide(tp, tp + fn);
    case StatKind::kPrecision: return detail::safe_divide(tp, tp + fp, zd);
    case StatKind::kRecall: return detail::safe_divide(tp, tp + fn, zd);
    case StatKind::kFBeta: {
      const double b2 = beta * beta;
      return detail::safe_divide(tp.mul(1 + b2), tp.mul(1 + b2) + fn.mul(b2) + fp, zd);
    }
  }
  return {};
}

}  // namespace

ClassificationMetric::ClassificationMetric(StatKind kind, const MetricOptions& o)
    : Metric(kind_name(kind), o.device), kind_(kind), options_(o) {
  auto opts = torch::TensorOptions().dtype(torch::kLong).device(o.device);
  switch (o.task) {
    case Task::kBinary: confmat_ = add_state("confmat", torch::zeros({2, 2}, opts), Reduction::kSum); break;
    case Task::kMulticlass:
      TORCH_CHECK(o.num_classes >= 2, name(), ": multiclass needs num_classes >= 2, got ", o.num_classes);
      TORCH_CHECK(o.top_k >= 1 && o.top_k <= o.num_classes, name(), ": top_k must be in [1, num_classes], got ",
                  o.top_k);
      confmat_ = add_state("confmat", torch::zeros({o.num_classes, o.num_classes}, opts), Reduction::kSum);
      break;
    case Task::kMultilabel:
      TORCH_CHECK(o.num_classes >= 1, name(), ": multilabel needs num_classes (labels) >= 1");
      confmat_ = add_state("confmat", torch::zeros({o.num_classes, 2, 2}, opts), Reduction::kSum);
      break;
  }
}

std::string ClassificationMetric::state_signature() const {
  // Everything update() reads; the statistic and the averaging only matter in compute().
  const auto& o = options_;
  std::string sig = "confmat/task=" + std::to_string(static_cast<int>(o.task)) + "/c=" + std::to_string(o.num_classes) +
                    "/k=" + std::to_string(o.top_k) + "/thr=" + std::to_string(o.threshold) +
                    "/nan=" + std::to_string(static_cast<int>(o.nan_strategy)) + ":" + std::to_string(o.nan_replacement);
  if (o.ignore_index) sig += "/ignore=" + std::to_string(*o.ignore_index);
  return sig;
}

void ClassificationMetric::update(const torch::Tensor& preds, const torch::Tensor& target) {
  TORCH_CHECK(preds.defined() && target.defined(), name(), ".update(preds, target): both are required");
  torch::NoGradGuard no_grad;
  switch (options_.task) {
    case Task::kBinary: update_binary(preds.detach(), target.detach()); break;
    case Task::kMulticlass: update_multiclass(preds.detach(), target.detach()); break;
    case Task::kMultilabel: update_multilabel(preds.detach(), target.detach()); break;
  }
}

void ClassificationMetric::update_multiclass(const torch::Tensor& preds, const torch::Tensor& target) {
  const int64_t c = options_.num_classes;
  auto t = target.reshape({-1}).to(torch::kLong);
  torch::Tensor label;
  torch::Tensor valid = t.ge(0).logical_and_(t.lt(c));
  if (preds.dim() == target.dim() + 1) {
    TORCH_CHECK(preds.size(1) == c, name(), ": preds have ", preds.size(1), " classes in dim 1, expected ", c);
    auto s = classes_last(preds, c);
    if (options_.nan_strategy == NanStrategy::kIgnore) {
      valid.logical_and_(s.isnan().any(1).logical_not_());
    } else if (options_.nan_strategy == NanStrategy::kReplace) {
      s = s.masked_fill(s.isnan(), options_.nan_replacement);
    }
    if (options_.top_k == 1) {
      label = s.argmax(1);
    } else {
      auto top = std::get<1>(s.topk(options_.top_k, 1));
      auto hit = top.eq(t.unsqueeze(1)).any(1);
      label = torch::where(hit, t, top.select(1, 0));
    }
  } else {
    TORCH_CHECK(preds.sizes() == target.sizes(), name(), ": preds ", preds.sizes(), " vs target ", target.sizes(),
                ": expected scores [N, C, ...] or labels of the target's shape");
    TORCH_CHECK(options_.top_k == 1, name(), ": top_k > 1 needs scores [N, C, ...], not labels");
    label = preds.reshape({-1}).to(torch::kLong);
    valid.logical_and_(label.ge(0)).logical_and_(label.lt(c));
  }
  if (options_.ignore_index) valid.logical_and_(t.ne(*options_.ignore_index));
  auto index = t.clamp(0, c - 1).mul_(c).add_(label.clamp(0, c - 1));
  state(confmat_).view({-1}).index_add_(0, index, valid.to(torch::kLong));
}

void ClassificationMetric::update_binary(const torch::Tensor& preds, const torch::Tensor& target) {
  TORCH_CHECK(preds.sizes() == target.sizes(), name(), ": binary preds ", preds.sizes(), " vs target ",
              target.sizes());
  auto p = preds.reshape({-1});
  auto t = target.reshape({-1}).to(torch::kLong);
  auto valid = t.eq(0).logical_or_(t.eq(1));
  if (p.is_floating_point()) {
    if (options_.nan_strategy == NanStrategy::kIgnore) valid.logical_and_(p.isnan().logical_not());
    if (options_.nan_strategy == NanStrategy::kReplace) p = p.masked_fill(p.isnan(), options_.nan_replacement);
    p = sigmoid_if_logits(p).gt(options_.threshold);
  }
  if (options_.ignore_index) valid.logical_and_(t.ne(*options_.ignore_index));
  auto index = t.clamp(0, 1).mul_(2).add_(p.to(torch::kLong).clamp(0, 1));
  state(confmat_).view({-1}).index_add_(0, index, valid.to(torch::kLong));
}

void ClassificationMetric::update_multilabel(const torch::Tensor& preds, const torch::Tensor& target) {
  const int64_t l = options_.num_classes;
  TORCH_CHECK(preds.sizes() == target.sizes() && preds.dim() >= 2 && preds.size(1) == l, name(),
              ": multilabel preds and target must both be [N, ", l, ", ...], got ", preds.sizes(), " and ",
              target.sizes());
  auto p = classes_last(preds, l);
  auto t = classes_last(target, l).to(torch::kLong);
  auto valid = t.eq(0).logical_or_(t.eq(1));
  if (p.is_floating_point()) {
    if (options_.nan_strategy == NanStrategy::kIgnore) valid.logical_and_(p.isnan().logical_not());
    if (options_.nan_strategy == NanStrategy::kReplace) p = p.masked_fill(p.isnan(), options_.nan_replacement);
    p = sigmoid_if_logits(p).gt(options_.threshold);
  }
  if (options_.ignore_index) valid.logical_and_(t.ne(*options_.ignore_index));
  auto labels = torch::arange(l, t.options()).mul_(4);  // [L]: start of each label's 2x2 block
  auto index = t.clamp(0, 1).mul_(2).add_(p.to(torch::kLong).clamp(0, 1)).add_(labels);
  state(confmat_).view({-1}).index_add_(0, index.reshape({-1}), valid.to(torch::kLong).reshape({-1}));
}

std::array<torch::Tensor, 4> ClassificationMetric::stat_scores() const {
  const auto& cm = state(confmat_);
  if (options_.task == Task::kMulticlass) {
    auto tp = cm.diagonal();
    auto fp = cm.sum(0) - tp;
    auto fn = cm.sum(1) - tp;
    auto tn = cm.sum() - tp - fp - fn;
    return {tp, fp, tn, fn};
  }
  // Binary [2, 2] and multilabel [L, 2, 2]: [..., target, prediction].
  auto at = [&](int64_t target, int64_t pred) { return cm.select(-2, target).select(-1, pred); };
  return {at(1, 1), at(0, 1), at(0, 0), at(1, 0)};
}

torch::Tensor ClassificationMetric::compute() const {
  auto [tp_i, fp_i, tn_i, fn_i] = stat_scores();
  auto tp = tp_i.to(torch::kDouble), fp = fp_i.to(torch::kDouble), tn = tn_i.to(torch::kDouble),
       fn = fn_i.to(torch::kDouble);
  const double zd = options_.zero_division;
  const bool multilabel = options_.task == Task::kMultilabel;
  if (options_.task == Task::kBinary) {
    return ratio_for(kind_, tp, fp, tn, fn, true, options_.beta, zd).to(torch::kFloat);
  }
  if (options_.average == Average::kMicro) {
    return ratio_for(kind_, tp.sum(), fp.sum(), tn.sum(), fn.sum(), multilabel, options_.beta, zd).to(torch::kFloat);
  }
  auto score = ratio_for(kind_, tp, fp, tn, fn, multilabel, options_.beta, zd);
  if (options_.average == Average::kNone) return score.to(torch::kFloat);
  torch::Tensor weights;
  if (options_.average == Average::kWeighted) {
    weights = tp + fn;
  } else {
    weights = torch::ones_like(score);
    if (!multilabel) {
      // TorchMetrics passes top_k to this rule for accuracy/precision/recall but not for F-beta.
      const bool top1_rule = options_.top_k == 1 || kind_ == StatKind::kFBeta;
      auto absent = top1_rule ? (tp + fp + fn).eq(0) : (tp + fn).eq(0);
      weights.masked_fill_(absent, 0.0);
    }
  }
  return detail::safe_divide(weights * score, weights.sum()).sum().to(torch::kFloat);
}

STROBE_REGISTER(metric_registry(), "accuracy", metric_factory<Accuracy>());
STROBE_REGISTER(metric_registry(), "precision", metric_factory<Precision>());
STROBE_REGISTER(metric_registry(), "recall", metric_factory<Recall>());
STROBE_REGISTER(metric_registry(), "f1", metric_factory<F1Score>());
STROBE_REGISTER(metric_registry(), "fbeta", metric_factory<FBetaScore>());

}  // namespace strobe::metrics
