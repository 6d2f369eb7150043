#pragma once
// Mean IoU / mean GIoU of matched boxes: prediction i is compared with target i (no assignment).
// Boxes are xyxy in the last dimension, padded: [..., N, 4] for both, e.g. [B, 256, 4]. A pair
// counts when its target is valid: target's last coordinate (y2) > 0 — the padding rule of the
// data pipeline and of the giou_loss op. compute() = sum over valid pairs / number of valid pairs
// (0 when there is none, as TorchMetrics' functional intersection_over_union of an empty set).
// Per-pair values follow torchvision's box_iou / generalized_box_iou (no epsilon), so a valid
// degenerate pair (zero union) is NaN and goes through nan_strategy.
#include "strobe/metrics/metric.h"

namespace strobe::metrics {

class BoxIoUMetric : public Metric {
 public:
  BoxIoUMetric(bool generalized, const MetricOptions& options);
  void update(const torch::Tensor& pred_boxes, const torch::Tensor& target_boxes) override;
  torch::Tensor compute() const override;

 private:
  bool generalized_;
  NanStrategy nan_strategy_;
  double nan_replacement_;
  size_t sum_, count_;
};

class MeanIoU : public BoxIoUMetric {
 public:
  explicit MeanIoU(const MetricOptions& options = {}) : BoxIoUMetric(false, options) {}
};

class MeanGIoU : public BoxIoUMetric {
 public:
  explicit MeanGIoU(const MetricOptions& options = {}) : BoxIoUMetric(true, options) {}
};

// Elementwise IoU (or GIoU) of matched xyxy boxes [..., 4] -> [...], in float32 or wider.
torch::Tensor matched_box_iou(const torch::Tensor& a, const torch::Tensor& b, bool generalized);

}  // namespace strobe::metrics
