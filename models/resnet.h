// ResNet (He et al.), the torchvision architecture: BasicBlock for depth 18/34, Bottleneck (stride on
// the 3x3 conv, "ResNet v1.5") for depth 50. Parameter names and counts equal torchvision's
// (resnet18, 1000 classes: 11,689,512; resnet50: 25,557,032), so its weights load by name.
//
// Extensions (defaults reproduce torchvision): `in_channels` (1 for Fashion-MNIST), `width` (channels
// of the first stage; the stages use width, 2w, 4w, 8w — e.g. 16 for a thin CPU variant) and
// `stem: cifar` (3x3 stride-1 conv, no max-pool: keeps resolution on 28x28/32x32 inputs).
// `memory_format`: channels_last keeps the convolution weights and activations NHWC (cuDNN's fast
// layout for bf16/fp16 on tensor cores: ResNet-50 b128 bf16 on an H200 trains in 29 instead of 54 ms
// per step in PyTorch eager); auto = channels_last on CUDA under bf16/fp16 precisions, contiguous
// elsewhere (fp32 NHWC convolutions are slower in cuDNN). Values and
// state-dict names do not change with the layout.
// `fused_bn`: in training, each BatchNorm with what follows it (ReLU; the residual add and ReLU at
// the end of a block) runs as one strobe::batch_norm_act op: 4 passes over each activation instead
// of ATen's 6-7. auto = where its CUDA kernels take the tensors (channels_last, C % 8 == 0, fp32
// BatchNorm parameters: every ResNet on CUDA under bf16/fp16 precisions), ATen elsewhere; true = the
// op everywhere (its CPU implementation on CPU; a tensor the CUDA kernels cannot take is an error);
// false = ATen. Evaluation uses the running statistics through ATen either way.
// `custom_pool`: the stem's 3x3 stride-2 max-pool as strobe::max_pool2d (a one-byte argmax and a
// gather backward instead of ATen's int64 indices) — auto = on CUDA where its kernels take the
// activation (fp32/bf16/fp16, contiguous or channels_last), ATen elsewhere; true = the op everywhere
// (its CPU kernel on CPU); false = ATen. Values and gradients are the same either way.
// Input: batch["image"], float [B, C, H, W] of any H, W >= 1 (global average pooling at the end).
#pragma once

#include <memory>
#include <string>

#include "strobe/core/activation_checkpoint.h"
#include "strobe/core/model.h"

namespace strobe::models {

struct ResNetOptions {
  int64_t depth = 18;  // 18 | 34 | 50
  int64_t num_classes = 1000;
  int64_t in_channels = 3;
  int64_t width = 64;
  std::string stem = "imagenet";  // imagenet | cifar
  std::string memory_format = "auto";  // auto | channels_last | contiguous
  std::string fused_bn = "auto";       // auto | true | false
  std::string custom_pool = "auto";    // auto | true | false
  ActivationCheckpointing activation_checkpointing;  // over the residual blocks, counted across stages
};

std::shared_ptr<Model> make_resnet(const ResNetOptions& options);

}  // namespace strobe::models
