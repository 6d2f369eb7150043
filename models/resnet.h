// ResNet (He et al.), the torchvision architecture: BasicBlock for depth 18/34, Bottleneck (stride on
// the 3x3 conv, "ResNet v1.5") for depth 50. Parameter names and counts equal torchvision's
// (resnet18, 1000 classes: 11,689,512; resnet50: 25,557,032), so its weights load by name.
//
// Extensions (defaults reproduce torchvision): `in_channels` (1 for Fashion-MNIST), `width` (channels
// of the first stage; the stages use width, 2w, 4w, 8w — e.g. 16 for a thin CPU variant) and
// `stem: cifar` (3x3 stride-1 conv, no max-pool: keeps resolution on 28x28/32x32 inputs).
// Input: batch["image"], float [B, C, H, W] of any H, W >= 1 (global average pooling at the end).
#pragma once

#include <memory>
#include <string>

#include "framework/core/model.h"

namespace strobe::models {

struct ResNetOptions {
  int64_t depth = 18;  // 18 | 34 | 50
  int64_t num_classes = 1000;
  int64_t in_channels = 3;
  int64_t width = 64;
  std::string stem = "imagenet";  // imagenet | cifar
};

std::shared_ptr<Model> make_resnet(const ResNetOptions& options);

}  // namespace strobe::models
