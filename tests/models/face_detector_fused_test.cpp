// model.fused_conv: the face detector with its conv stages through strobe::conv3x3_maxpool_relu
// gives the same outputs and gradients as the ATen modules, with the same parameter names.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "tests/models/model_test_util.h"

namespace strobe {
namespace {

using testing::build_model;
using testing::copy_weights;
using testing::image_batch;

TEST(FaceDetectorFused, SameOutputsGradientsAndParameterNamesAsAten) {
  torch::manual_seed(11);
  const std::string base = "name: face_detector, image_size: 32, max_boxes: 4, hidden_dim: 16";
  auto aten = build_model("{" + base + ", fused_conv: false}");
  for (int stages : {1, 4}) {
    auto fused = build_model("{" + base + ", fused_conv: true, fused_conv_stages: " +
                             std::to_string(stages) + "}");
    ASSERT_EQ(aten->named_parameters().keys(), fused->named_parameters().keys());
    copy_weights(*aten, *fused);
    const torch::Tensor img = torch::randint(0, 256, {3, 1, 32, 32}, torch::kUInt8);
    aten->zero_grad();
    fused->zero_grad();
    const torch::Tensor ya = aten->forward(image_batch(img)), yf = fused->forward(image_batch(img));
    EXPECT_TRUE(torch::allclose(yf, ya, 1e-4, 1e-4)) << "stages " << stages;
    const torch::Tensor seed = torch::randn(ya.sizes());
    (ya * seed).sum().backward();
    (yf * seed).sum().backward();
    auto ga = aten->named_parameters();
    for (const auto& kv : fused->named_parameters()) {
      const torch::Tensor want = ga[kv.key()].grad(), got = kv.value().grad();
      ASSERT_TRUE(got.defined()) << kv.key();
      const double err = (got - want).norm().item<double>() / (want.norm().item<double>() + 1e-12);
      EXPECT_LT(err, 1e-4) << kv.key() << " stages " << stages;
    }
  }
}

TEST(FaceDetectorFused, Bf16ParametersGiveBf16Activations) {
  // With bf16 parameters (no autocast) the fused stages emit bf16, so the ATen stages after them
  // see the dtype their weights have (uint8 images would otherwise leave the op as fp32).
  auto m = build_model("{name: face_detector, image_size: 32, max_boxes: 4, hidden_dim: 16, fused_conv: true}");
  m->to(torch::kBFloat16);
  const torch::Tensor y = m->forward(image_batch(torch::randint(0, 256, {2, 1, 32, 32}, torch::kUInt8)));
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
}

TEST(FaceDetectorFused, BadKeysAreConfigErrors) {
  EXPECT_THROW(build_model("{name: face_detector, image_size: 32, fused_conv: maybe}"),
               config::ConfigError);
  EXPECT_THROW(build_model("{name: face_detector, image_size: 32, fused_conv_stages: 5}"),
               config::ConfigError);
}

}  // namespace
}  // namespace strobe
