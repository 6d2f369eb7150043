// Vision Transformer (Dosovitskiy et al.), pre-LN encoder blocks with a fused qkv projection.
// With class_token: true, global_pool: token, qkv_bias: true it is torchvision's VisionTransformer
// (vit_l_16: img 224, patch 16, dim 1024, depth 24, heads 16, mlp 4096 -> 304,326,632 parameters);
// with class_token: false, global_pool: avg it is timm's VisionTransformer as the seed configures it
// (LayerNorm after pooling, timm's fc_norm). LayerNorm eps 1e-6 as both.
// Input: batch["image"] float [B, C, img_size, img_size]. Output: logits [B, num_classes].
#pragma once

#include <memory>
#include <string>

#include "strobe/core/activation_checkpoint.h"
#include "strobe/core/model.h"
#include "models/attention.h"
#include "models/fused_ops.h"

namespace strobe::models {

struct ViTOptions {
  int64_t img_size = 224, patch_size = 16, in_channels = 3, num_classes = 1000;
  int64_t embed_dim = 768, depth = 12, num_heads = 12;
  double mlp_ratio = 4.0;
  bool class_token = true;
  std::string global_pool = "token";  // token | avg
  bool qkv_bias = true;
  AttentionBackend attention = AttentionBackend::Math;
  FusedOps fused_ops = FusedOps::kAuto;  // models/fused_ops.h
  ActivationCheckpointing activation_checkpointing;  // over the blocks (strobe/core/activation_checkpoint.h)
  std::string gelu = "erf";  // erf (exact) | tanh (the approximation; strobe::fused_mlp with fused ops)
};

std::shared_ptr<Model> make_vit(const ViTOptions& options);

}  // namespace strobe::models
