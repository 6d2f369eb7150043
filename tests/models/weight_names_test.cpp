// Weight name maps (strobe/core/weight_names.h): each map names every tensor of the model once,
// spells the other library's names as its state dict does (the names below are read off timm's and
// torchvision's state dicts; tests/python/test_pretrained.py loads real ones), and refuses the
// configurations the other library cannot build.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "strobe/config/config.h"
#include "strobe/core/model.h"
#include "strobe/core/weight_names.h"

namespace strobe {
namespace {

std::shared_ptr<Model> build(const std::string& yaml) {
  auto doc = config::Document::load_string(yaml, "model");
  auto section = doc.root();
  return model_registry().create(section, "");
}

std::map<std::string, std::string> map_of(const std::string& family, const std::string& names, const std::string& yaml) {
  auto model = build(yaml);
  std::map<std::string, std::string> out;
  for (const auto& e : make_name_map(family, names, *model).entries) out[e.strobe] = e.external;
  return out;
}

std::string refusal(const std::string& family, const std::string& names, const std::string& yaml) {
  auto model = build(yaml);
  try {
    make_name_map(family, names, *model);
  } catch (const WeightNamesError& e) {
    return e.what();
  }
  return "";
}

const char* kVit = "{name: vit, img_size: 32, patch_size: 8, num_classes: 10, embed_dim: 32, depth: 2, num_heads: 2";

TEST(WeightNames, VitToTimmRenamesAttentionMlpAndPatchEmbedAndPicksFcNormByPooling) {
  auto token = map_of("vit", "timm", std::string(kVit) + "}");
  EXPECT_EQ(token.size(), 4u + 2 * 12 + 4);  // patch_embed w/b, cls, pos; 12 per block; norm, head
  const std::map<std::string, std::string> want = {
      {"patch_embed.weight", "patch_embed.proj.weight"}, {"patch_embed.bias", "patch_embed.proj.bias"},
      {"cls_token", "cls_token"}, {"pos_embed", "pos_embed"},
      {"blocks.1.norm1.weight", "blocks.1.norm1.weight"}, {"blocks.1.qkv.weight", "blocks.1.attn.qkv.weight"},
      {"blocks.1.qkv.bias", "blocks.1.attn.qkv.bias"}, {"blocks.1.proj.bias", "blocks.1.attn.proj.bias"},
      {"blocks.0.norm2.bias", "blocks.0.norm2.bias"}, {"blocks.0.fc1.weight", "blocks.0.mlp.fc1.weight"},
      {"blocks.0.fc2.bias", "blocks.0.mlp.fc2.bias"}, {"norm.weight", "norm.weight"}, {"head.bias", "head.bias"}};
  for (const auto& [strobe_name, timm_name] : want) EXPECT_EQ(token.at(strobe_name), timm_name) << strobe_name;

  auto avg = map_of("vit", "timm", std::string(kVit) + ", class_token: false, global_pool: avg}");
  EXPECT_EQ(avg.count("cls_token"), 0u);
  EXPECT_EQ(avg.at("norm.weight"), "fc_norm.weight");  // timm normalises after the mean (norm is an Identity)
  EXPECT_EQ(avg.at("norm.bias"), "fc_norm.bias");

  EXPECT_NE(refusal("vit", "timm", std::string(kVit) + ", class_token: true, global_pool: avg}").find(
                "averages the patch tokens alone"),
            std::string::npos);
}

TEST(WeightNames, VitToTorchvisionIsItsEncoderLayout) {
  auto tv = map_of("vit", "torchvision", std::string(kVit) + "}");
  const std::map<std::string, std::string> want = {
      {"patch_embed.weight", "conv_proj.weight"}, {"cls_token", "class_token"}, {"pos_embed", "encoder.pos_embedding"},
      {"blocks.1.norm1.bias", "encoder.layers.encoder_layer_1.ln_1.bias"},
      {"blocks.1.qkv.weight", "encoder.layers.encoder_layer_1.self_attention.in_proj_weight"},
      {"blocks.1.qkv.bias", "encoder.layers.encoder_layer_1.self_attention.in_proj_bias"},
      {"blocks.1.proj.weight", "encoder.layers.encoder_layer_1.self_attention.out_proj.weight"},
      {"blocks.0.norm2.weight", "encoder.layers.encoder_layer_0.ln_2.weight"},
      {"blocks.0.fc1.bias", "encoder.layers.encoder_layer_0.mlp.0.bias"},
      {"blocks.0.fc2.weight", "encoder.layers.encoder_layer_0.mlp.3.weight"},
      {"norm.weight", "encoder.ln.weight"}, {"head.weight", "heads.head.weight"}};
  for (const auto& [strobe_name, tv_name] : want) EXPECT_EQ(tv.at(strobe_name), tv_name) << strobe_name;
  EXPECT_NE(refusal("vit", "torchvision", std::string(kVit) + ", class_token: false, global_pool: avg}").find("class token"),
            std::string::npos);
  EXPECT_NE(refusal("vit", "torchvision", std::string(kVit) + ", qkv_bias: false}").find("qkv_bias: true"),
            std::string::npos);
}

TEST(WeightNames, ResnetNamesAreTorchvisionsAndTimmsForTheirArchitectureOnly) {
  const std::string yaml = "{name: resnet, depth: 18, num_classes: 10}";
  for (const char* names : {"timm", "torchvision"}) {
    auto m = map_of("resnet", names, yaml);
    EXPECT_EQ(m.size(), 62u + 60u) << names;  // 62 parameters, 3 buffers in each of 20 BatchNorms
    for (const auto& [strobe_name, ext] : m) EXPECT_EQ(strobe_name, ext);
    EXPECT_EQ(m.count("layer4.1.bn2.num_batches_tracked"), 1u);
    EXPECT_NE(refusal("resnet", names, "{name: resnet, depth: 18, stem: cifar}").find("no stem 'cifar'"),
              std::string::npos);
    EXPECT_NE(refusal("resnet", names, "{name: resnet, depth: 18, width: 16}").find("width: 64"), std::string::npos);
  }
  // One input channel: conv1.weight is then [64, 1, 7, 7], a shape mismatch that init_from lists
  // (or `ignore` leaves out), not a refusal.
  EXPECT_EQ(refusal("resnet", "torchvision", "{name: resnet, depth: 18, in_channels: 1}"), "");
}

TEST(WeightNames, AnUnknownNameSetListsWhatTheFamilyHas) {
  auto model = build("{name: vit, img_size: 32, patch_size: 8, embed_dim: 32, depth: 1, num_heads: 2}");
  EXPECT_EQ(name_sets("vit"), (std::vector<std::string>{"strobe", "timm", "torchvision"}));
  try {
    make_name_map("vit", "hf", *model);
    FAIL() << "no error";
  } catch (const WeightNamesError& e) {
    EXPECT_STREQ(e.what(), "model 'vit' has no name set 'hf' (it has: strobe, timm, torchvision)");
  }
  try {
    make_name_map("vit", "tim", *model);
    FAIL() << "no error";
  } catch (const WeightNamesError& e) {
    EXPECT_STREQ(e.what(), "model 'vit' has no name set 'tim'; did you mean 'timm'? (it has: strobe, timm, torchvision)");
  }
}

}  // namespace
}  // namespace strobe
