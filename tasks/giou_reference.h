// GIoU on padded boxes in ATen ops: the reference the strobe::giou_loss op is tested against, and
// the detection task's loss where the op is not used. Standard GIoU, as
// torchvision.ops.generalized_box_iou: the overlap's width/height are clamped at 0 (the seed's
// generalized_box_iou in bench/pytorch_baselines.py does not clamp and diverges for boxes disjoint
// on both axes); otherwise as the seed: eps 1e-5 clamps on union and enclosing area, and
// loss_with_padding (a target row is valid when its last coordinate, y2, is > 0; the mean is over
// valid rows, 0 when there is none).
#pragma once

#include <string>

#include <torch/types.h>

namespace strobe::tasks {

// Elementwise GIoU of boxes [..., 4] (x1, y1, x2, y2) -> [...]; computed in fp32 (fp64 for fp64).
torch::Tensor generalized_box_iou_reference(const torch::Tensor& boxes1, const torch::Tensor& boxes2);

// loss_with_padding(pred, target): GIoU(target, pred) over valid rows of [B, N, 4].
// reduction: "mean" (sum / max(#valid, 1)), "sum", or "none" ([B, N], 0 for invalid rows).
// This is the GIoU *value* (higher is better), as the op defines it; a loss to minimize is
// giou_objective_from_mean below.
torch::Tensor giou_loss_padded_reference(const torch::Tensor& pred, const torch::Tensor& target,
                                         const std::string& reduction = "mean");

// 1 - mean GIoU over valid rows (0 when there is none), from the "mean" value above and the target:
// what the detection task minimizes. Its gradient is exactly minus the gradient of the mean GIoU.
torch::Tensor giou_objective_from_mean(const torch::Tensor& mean_giou, const torch::Tensor& target);

}  // namespace strobe::tasks
