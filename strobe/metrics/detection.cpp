#include "strobe/metrics/detection.h"

#include "strobe/metrics/registry.h"

namespace strobe::metrics {

torch::Tensor matched_box_iou(const torch::Tensor& a_in, const torch::Tensor& b_in, bool generalized) {
  const auto dtype = torch::promote_types(torch::promote_types(a_in.scalar_type(), b_in.scalar_type()), torch::kFloat);
  auto a = a_in.to(dtype), b = b_in.to(dtype);
  auto ax1 = a.select(-1, 0), ay1 = a.select(-1, 1), ax2 = a.select(-1, 2), ay2 = a.select(-1, 3);
  auto bx1 = b.select(-1, 0), by1 = b.select(-1, 1), bx2 = b.select(-1, 2), by2 = b.select(-1, 3);
  auto area_a = (ax2 - ax1) * (ay2 - ay1);
  auto area_b = (bx2 - bx1) * (by2 - by1);
  auto iw = (torch::minimum(ax2, bx2) - torch::maximum(ax1, bx1)).clamp_min(0);
  auto ih = (torch::minimum(ay2, by2) - torch::maximum(ay1, by1)).clamp_min(0);
  auto inter = iw * ih;
  auto uni = area_a + area_b - inter;
  auto iou = inter / uni;
  if (!generalized) return iou;
  auto ew = (torch::maximum(ax2, bx2) - torch::minimum(ax1, bx1)).clamp_min(0);
  auto eh = (torch::maximum(ay2, by2) - torch::minimum(ay1, by1)).clamp_min(0);
  auto enclose = ew * eh;
  return iou - (enclose - uni) / enclose;
}

BoxIoUMetric::BoxIoUMetric(bool generalized, const MetricOptions& o)
    : Metric(generalized ? "mean_giou" : "mean_iou", o.device),
      generalized_(generalized),
      nan_strategy_(o.nan_strategy),
      nan_replacement_(o.nan_replacement) {
  auto d = torch::TensorOptions().dtype(torch::kFloat64).device(o.device);
  sum_ = add_state("sum", torch::zeros({}, d), Reduction::kSum);
  count_ = add_state("count", torch::zeros({}, d), Reduction::kSum);
}

void BoxIoUMetric::update(const torch::Tensor& pred_boxes, const torch::Tensor& target_boxes) {
  TORCH_CHECK(pred_boxes.sizes() == target_boxes.sizes() && pred_boxes.size(-1) == 4, name(),
              ": pred and target boxes must have the same shape [..., 4], got ", pred_boxes.sizes(), " and ",
              target_boxes.sizes());
  torch::NoGradGuard no_grad;
  auto t = target_boxes.detach();
  auto iou = matched_box_iou(pred_boxes.detach(), t, generalized_).to(torch::kFloat64);
  auto valid = t.select(-1, 3).gt(0);
  // The strategy only looks at valid pairs; padding pairs (often 0 / 0 = NaN) never count.
  if (nan_strategy_ == NanStrategy::kIgnore) valid.logical_and_(iou.isnan().logical_not());
  if (nan_strategy_ == NanStrategy::kReplace) iou = iou.masked_fill(iou.isnan(), nan_replacement_);
  state(sum_).add_(iou.masked_fill(valid.logical_not(), 0.0).sum());
  state(count_).add_(valid.sum());
}

torch::Tensor BoxIoUMetric::compute() const {
  return detail::safe_divide(state(sum_), state(count_)).to(torch::kFloat);
}

STROBE_REGISTER(metric_registry(), "mean_iou", metric_factory<MeanIoU>());
STROBE_REGISTER(metric_registry(), "mean_giou", metric_factory<MeanGIoU>());

}  // namespace strobe::metrics
