#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/data/collate_tokens.h"
#include "tests/models/model_test_util.h"

namespace strobe {
namespace {

using testing::build_model;
using testing::count_parameters;
using testing::image_batch;

TEST(ResNet, ParameterCountsEqualTorchvision) {
  EXPECT_EQ(count_parameters(*build_model("{name: resnet, depth: 18, num_classes: 1000}")), 11689512);
  EXPECT_EQ(count_parameters(*build_model("{name: resnet, depth: 34, num_classes: 1000}")), 21797672);
  EXPECT_EQ(count_parameters(*build_model("{name: resnet, depth: 50, num_classes: 1000}")), 25557032);
}

TEST(ResNet, Resnet18ClassifiesOne64x64Image) {
  torch::manual_seed(0);
  auto m = build_model("{name: resnet, depth: 18, num_classes: 1000}");
  m->eval();
  torch::NoGradGuard guard;
  auto y = m->forward(image_batch(torch::randn({1, 3, 64, 64})));
  EXPECT_EQ(y.sizes(), (torch::IntArrayRef{1, 1000}));
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
}

TEST(ResNet, ThinOneChannelVariantTakesFashionMnistImages) {
  torch::NoGradGuard guard;
  for (const char* stem : {"imagenet", "cifar"}) {
    auto m = build_model(std::string("{name: resnet, depth: 18, num_classes: 10, in_channels: 1, width: 4, stem: ") + stem + "}");
    m->eval();
    auto y = m->forward(image_batch(torch::randn({2, 1, 28, 28})));
    EXPECT_EQ(y.sizes(), (torch::IntArrayRef{2, 10})) << stem;
  }
  auto bottleneck = build_model("{name: resnet, depth: 50, num_classes: 10, in_channels: 1, width: 4}");
  bottleneck->eval();
  EXPECT_EQ(bottleneck->forward(image_batch(torch::randn({2, 1, 28, 28}))).sizes(), (torch::IntArrayRef{2, 10}));
}

// memory_format: channels_last (what auto picks on CUDA) changes the layout of the conv weights and
// activations, not the values: same outputs and gradients as the contiguous model, parameters NHWC,
// the same state-dict names; auto leaves a CPU model contiguous.
TEST(ResNet, ChannelsLastGivesTheSameOutputsAndGradients) {
  torch::manual_seed(3);
  const std::string base = "{name: resnet, depth: 18, num_classes: 10, in_channels: 3, width: 8, memory_format: ";
  auto plain = build_model(base + "contiguous}");
  auto nhwc = build_model(base + "channels_last}");
  auto autofmt = build_model(base + "auto}");
  testing::copy_weights(*plain, *nhwc);
  plain->on_device(torch::kCPU, Precision::k32);
  nhwc->on_device(torch::kCPU, Precision::k32);
  autofmt->on_device(torch::kCUDA, Precision::k32);  // auto: fp32 stays NCHW even on CUDA (nothing is moved here)
  const auto cl = at::MemoryFormat::ChannelsLast;
  int64_t converted = 0;
  for (const auto& p : nhwc->parameters())
    if (p.dim() == 4) {
      EXPECT_TRUE(p.is_contiguous(cl));
      converted += !p.is_contiguous();  // 1x1 kernels are both NCHW- and NHWC-contiguous
    }
  EXPECT_GT(converted, 10);
  for (const auto& p : autofmt->parameters()) EXPECT_TRUE(p.is_contiguous());
  EXPECT_EQ(plain->named_parameters().keys(), nhwc->named_parameters().keys());
  auto x = torch::randn({2, 3, 40, 40});
  auto y_plain = plain->forward(image_batch(x));
  auto y_nhwc = nhwc->forward(image_batch(x));
  EXPECT_TRUE(torch::allclose(y_plain, y_nhwc, 1e-4, 1e-5));
  y_plain.square().sum().backward();
  y_nhwc.square().sum().backward();
  auto gp = plain->named_parameters(), gn = nhwc->named_parameters();
  for (const auto& kv : gp) {
    // Relative to the gradient's largest element: the NHWC kernels sum in another order.
    const auto& g = kv.value().grad();
    const double err = (g - gn[kv.key()].grad()).abs().max().item<double>() / g.abs().max().item<double>();
    EXPECT_LT(err, 1e-4) << kv.key();
  }
}

TEST(ResNet, UnsupportedDepthIsAConfigError) {
  EXPECT_THROW(build_model("{name: resnet, depth: 20}"), config::ConfigError);
  EXPECT_THROW(build_model("{name: resnet, dept: 18}"), config::ConfigError);  // unknown key
}

int64_t vit_formula(int64_t c, int64_t img, int64_t p, int64_t d, int64_t depth, int64_t hidden, int64_t k, bool cls) {
  const int64_t n = (img / p) * (img / p) + (cls ? 1 : 0);
  const int64_t block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * hidden + hidden) + (hidden * d + d);
  return (c * p * p * d + d) + (cls ? d : 0) + n * d + depth * block + 2 * d + (d * k + k);
}

TEST(ViT, ShapesAndParameterCountFollowTheArchitecture) {
  auto cls = build_model("{name: vit, img_size: 32, patch_size: 8, in_channels: 3, num_classes: 10, embed_dim: 64, depth: 2, num_heads: 4}");
  EXPECT_EQ(count_parameters(*cls), vit_formula(3, 32, 8, 64, 2, 256, 10, true));
  EXPECT_EQ(cls->forward(image_batch(torch::randn({2, 3, 32, 32}))).sizes(), (torch::IntArrayRef{2, 10}));
  auto avg = build_model("{name: vit, img_size: 32, patch_size: 4, in_channels: 1, num_classes: 5, embed_dim: 32, depth: 1, "
                         "num_heads: 2, class_token: false, global_pool: avg, mlp_ratio: 2}");
  EXPECT_EQ(count_parameters(*avg), vit_formula(1, 32, 4, 32, 1, 64, 5, false));
  EXPECT_EQ(avg->forward(image_batch(torch::randn({3, 1, 32, 32}))).sizes(), (torch::IntArrayRef{3, 5}));
}

TEST(ViT, L16ParameterCountFormulaEqualsTorchvisionsVitL16) {
  // torchvision.models.vit_l_16(): 304,326,632 (class token, token pooling); the seed's timm model
  // (no class token, avg pooling) has one embedding row and the token fewer.
  EXPECT_EQ(vit_formula(3, 224, 16, 1024, 24, 4096, 1000, true), 304326632);
  EXPECT_EQ(vit_formula(3, 224, 16, 1024, 24, 4096, 1000, false), 304326632 - 2 * 1024);
}

TEST(ViT, SdpaAndMathBackendsAgree) {
  torch::manual_seed(1);
  const std::string base = "{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 2, num_heads: 4, attention: ";
  auto math = build_model(base + "math}");
  auto sdpa = build_model(base + "sdpa}");
  testing::copy_weights(*math, *sdpa);
  auto x = image_batch(torch::randn({2, 3, 16, 16}));
  EXPECT_TRUE(torch::allclose(math->forward(x), sdpa->forward(x), 1e-5, 1e-5));
}

TEST(ViT, CustomAndMathBackendsAgreeOnCpu) {
  torch::manual_seed(1);
  const std::string base = "{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 2, num_heads: 4, attention: ";
  auto math = build_model(base + "math}");
  auto custom = build_model(base + "custom}");
  testing::copy_weights(*math, *custom);
  auto x = image_batch(torch::randn({2, 3, 16, 16}));
  EXPECT_TRUE(torch::allclose(math->forward(x), custom->forward(x), 1e-5, 1e-5));
}

using testing::token_samples;

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
                                              torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
}

TEST(DecoderLM, PaddedWithMaskAndPackedGiveTheSameLoss) {
  torch::manual_seed(2);
  for (const char* attn : {"math", "sdpa", "custom"}) {
    auto m = build_model(std::string("{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 2, num_heads: 4, attention: ") +
                         attn + "}");
    auto samples = token_samples({3, 7, 1, 12}, 50);
    auto padded_max = data::collate_tokens_padded(samples, 16);
    auto padded_longest = data::collate_tokens_padded(samples, 0);
    auto packed = data::collate_tokens_packed(samples);
    auto l_max = lm_loss(m->forward(padded_max), padded_max.at("targets"));
    auto l_longest = lm_loss(m->forward(padded_longest), padded_longest.at("targets"));
    auto logits_packed = m->forward(packed);
    EXPECT_EQ(logits_packed.sizes(), (torch::IntArrayRef{23, 50}));
    auto l_packed = lm_loss(logits_packed, packed.at("targets"));
    EXPECT_NEAR(l_max.item<double>(), l_packed.item<double>(), 1e-5) << attn;
    EXPECT_NEAR(l_longest.item<double>(), l_packed.item<double>(), 1e-5) << attn;
    // Gradients agree too (same weights, same tokens).
    m->zero_grad();
    l_max.backward();
    auto g_padded = m->parameters()[0].grad().clone();
    m->zero_grad();
    lm_loss(m->forward(packed), packed.at("targets")).backward();
    EXPECT_TRUE(torch::allclose(g_padded, m->parameters()[0].grad(), 1e-5, 1e-6)) << attn;
  }
}

// The padded collates declare right padding, and the model then drops the key-padding mask (plain
// causal attention). Real positions must be unchanged; padding positions must differ from the masked
// path (proof that the mask really was dropped); a batch without the declaration keeps the mask.
TEST(DecoderLM, RightPaddedBatchesRunWithoutTheMask) {
  torch::manual_seed(5);
  for (const char* attn : {"math", "sdpa"}) {
    auto m = build_model(std::string("{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 2, num_heads: 4, attention: ") +
                         attn + "}");
    auto samples = token_samples({3, 7, 1, 12}, 50);
    auto declared = data::collate_tokens_padded(samples, 16);
    ASSERT_EQ(declared.meta.at("right_padded"), 1);
    auto undeclared = declared;
    undeclared.meta.erase("right_padded");
    auto no_mask = m->forward(declared);
    auto masked = m->forward(undeclared);
    auto real = declared.at("padding_mask");
    EXPECT_TRUE(torch::allclose(no_mask.index({real}), masked.index({real}), 1e-5, 1e-6)) << attn;
    auto pad = real.logical_not();
    EXPECT_FALSE(torch::allclose(no_mask.index({pad}), masked.index({pad}), 1e-3, 1e-3)) << attn;
    EXPECT_NEAR(lm_loss(no_mask, declared.at("targets")).item<double>(),
                lm_loss(masked, declared.at("targets")).item<double>(), 1e-5) << attn;
  }
}

// The llama with attention: custom on our padded collates: they declare right padding, so no mask
// reaches the kernel and the losses equal the packed ones; a padded batch without the declaration (a
// collate of one's own) needs the mask, which custom refuses, saying to pack.
TEST(Llama, CustomAttentionTakesRightPaddedBatchesAndRefusesAMask) {
  torch::manual_seed(6);
  const std::string base = "{name: llama, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 1, num_heads: 4, "
                           "num_kv_heads: 2, attention: ";
  auto math = build_model(base + "math}");
  auto custom = build_model(base + "custom}");
  testing::copy_weights(*math, *custom);
  auto samples = token_samples({3, 7, 1, 12}, 50);
  auto padded = data::collate_tokens_padded(samples, 16);
  auto packed = data::collate_tokens_packed(samples);
  EXPECT_NEAR(lm_loss(custom->forward(padded), padded.at("targets")).item<double>(),
              lm_loss(math->forward(packed), packed.at("targets")).item<double>(), 1e-5);
  auto undeclared = padded;
  undeclared.meta.erase("right_padded");
  try {
    custom->forward(undeclared);
    ADD_FAILURE() << "custom attention took a key-padding mask";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("custom takes no key padding mask; pack the batch instead (data.collate: pack)"),
              std::string::npos)
        << e.what();
  }
}

TEST(DecoderLM, PackedCustomMatchesMathOnCpu) {
  torch::manual_seed(4);
  const std::string base = "{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 2, num_heads: 4, attention: ";
  auto math = build_model(base + "math}");
  auto custom = build_model(base + "custom}");
  testing::copy_weights(*math, *custom);
  auto samples = token_samples({3, 7, 1, 12}, 50);
  auto packed = data::collate_tokens_packed(samples);
  auto l_math = lm_loss(math->forward(packed), packed.at("targets"));
  auto l_custom = lm_loss(custom->forward(packed), packed.at("targets"));
  EXPECT_NEAR(l_math.item<double>(), l_custom.item<double>(), 1e-5);
  l_math.backward();
  l_custom.backward();
  EXPECT_TRUE(torch::allclose(math->parameters()[0].grad(), custom->parameters()[0].grad(), 1e-4, 1e-6));
}

TEST(DecoderLM, ParameterCountIsTheSeedsArchitecture) {
  // Per block: 2 bias-free LayerNorms (2D), qkv (3D^2 + 3D), proj (D^2 + D), fc1 (4D^2 + 4D), fc2 (4D^2 + D).
  const int64_t v = 50, s = 16, d = 32, depth = 2;
  const int64_t block = 2 * d + 3 * d * d + 3 * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d;
  auto m = build_model("{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 2, num_heads: 4}");
  EXPECT_EQ(count_parameters(*m), v * d + s * d + depth * block + d * v + v);
}

TEST(FaceDetector, OutputsMaxBoxesBoxesPerImage) {
  auto m = build_model("{name: face_detector, image_size: 64, max_boxes: 256, hidden_dim: 32}");
  auto y = m->forward(image_batch(torch::randint(0, 256, {2, 1, 64, 64}, torch::kUInt8)));
  EXPECT_EQ(y.sizes(), (torch::IntArrayRef{2, 256, 4}));
  const int64_t convs = (1 * 4 * 9 + 4) + (4 * 16 * 9 + 16) + (16 * 64 * 9 + 64) + (64 * 256 * 9 + 256);
  EXPECT_EQ(count_parameters(*m), convs + (256 * 16 * 32 + 32) + (32 * 1024 + 1024));
  EXPECT_EQ(m->default_task(), "detection");
}

TEST(FaceDetector, ImageSizeMustBeAMultipleOf16) {
  EXPECT_THROW(build_model("{name: face_detector, image_size: 40}"), config::ConfigError);
}

}  // namespace
}  // namespace strobe
