#include "tasks/giou_reference.h"

#include <stdexcept>

#include <torch/torch.h>

namespace strobe::tasks {

torch::Tensor generalized_box_iou_reference(const torch::Tensor& boxes1, const torch::Tensor& boxes2) {
  const auto dtype = boxes1.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto b1 = boxes1.to(dtype), b2 = boxes2.to(dtype);
  constexpr double kEps = 1e-5;
  using torch::indexing::Ellipsis;
  using torch::indexing::Slice;
  auto c = [](const torch::Tensor& b, int64_t i) { return b.select(-1, i); };
  auto area1 = (c(b1, 2) - c(b1, 0)) * (c(b1, 3) - c(b1, 1));
  auto area2 = (c(b2, 2) - c(b2, 0)) * (c(b2, 3) - c(b2, 1));
  auto lo1 = b1.index({Ellipsis, Slice(0, 2)}), hi1 = b1.index({Ellipsis, Slice(2, 4)});
  auto lo2 = b2.index({Ellipsis, Slice(0, 2)}), hi2 = b2.index({Ellipsis, Slice(2, 4)});
  // Standard GIoU (torchvision.ops.generalized_box_iou): the overlap's width/height are clamped at
  // 0. The seed's formula does not clamp, so boxes disjoint on both axes get a positive
  // "intersection", a union below eps and a diverging loss.
  auto wh = (torch::min(hi1, hi2) - torch::max(lo1, lo2)).clamp_min(0);
  auto inter = c(wh, 0) * c(wh, 1);
  auto uni = area1 + area2 - inter;
  auto iou = inter / uni.clamp_min(kEps);
  auto whi = torch::max(hi1, hi2) - torch::min(lo1, lo2);
  auto area_c = (c(whi, 0) * c(whi, 1)).clamp_min(kEps);
  return iou - (area_c - uni) / area_c;
}

torch::Tensor giou_loss_padded_reference(const torch::Tensor& pred, const torch::Tensor& target,
                                         const std::string& reduction) {
  TORCH_CHECK(pred.dim() == 3 && pred.size(-1) == 4 && pred.sizes() == target.sizes(),
              "giou_loss_padded_reference: pred and target must both be [B, N, 4], got ", pred.sizes(), " and ",
              target.sizes());
  auto giou = generalized_box_iou_reference(target, pred);
  auto mask = (target.select(-1, 3) > 0).to(giou.scalar_type());
  // where() rather than a product, so NaN/Inf from an invalid (padding) row never leaks into sums or gradients.
  auto masked = torch::where(mask > 0, giou, torch::zeros_like(giou));
  if (reduction == "none") return masked;
  if (reduction == "sum") return masked.sum();
  if (reduction == "mean") return masked.sum() / mask.sum().clamp_min(1);
  throw std::invalid_argument("giou_loss_padded_reference: reduction must be mean, sum or none, got " + reduction);
}

torch::Tensor giou_objective_from_mean(const torch::Tensor& mean_giou, const torch::Tensor& target) {
  auto any_valid = (target.select(-1, 3) > 0).any().to(mean_giou.scalar_type());
  return any_valid - mean_giou;
}

}  // namespace strobe::tasks
