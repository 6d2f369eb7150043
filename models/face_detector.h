// The seed's face detector (custom-cuda-giou-kernel.txt): four stages of conv 3x3 'same' + max-pool 2
// + ReLU (channels 1 -> 4 -> 16 -> 64 -> 256), then lin1 (256 * (image_size/16)^2 -> hidden_dim),
// ReLU, lin2 (-> max_boxes * 4). Output [B, max_boxes, 4] boxes (x1, y1, x2, y2) in pixels, slot i
// trained against target i (no assignment, as in the seed).
// Input: batch["image"] [B, 1, image_size, image_size], uint8 (scaled by 1/255) or float (as is).
#pragma once

#include <memory>
#include <string>

#include "strobe/core/model.h"

namespace strobe::models {

// fused_conv: the first fused_conv_stages conv stages through the fused op
// strobe::conv3x3_maxpool_relu (kAuto: when the input is on CUDA and the ops were built with CUDA;
// kOn: on any device, the op's CPU kernel on CPU; kOff: ATen's conv2d / max_pool2d / relu).
enum class FusedConv { kAuto, kOn, kOff };
// custom_pool ("auto" | "true" | "false", models/fused_ops.h): the max-pools of the stages that do not
// run fused (by default stages 3 and 4) as strobe::max_pool2d (one-byte argmax, gather backward)
// instead of ATen's; auto = where its CUDA kernels take the activation, true = always (its CPU kernel
// on CPU), false = ATen.

struct FaceDetectorOptions {
  int64_t image_size = 256, max_boxes = 256, hidden_dim = 256 * 64;
  FusedConv fused_conv = FusedConv::kAuto;
  int64_t fused_conv_stages = 2;
  std::string custom_pool = "auto";
};

std::shared_ptr<Model> make_face_detector(const FaceDetectorOptions& options);

}  // namespace strobe::models
