// strobe::max_pool2d on CPU (the reference of the CUDA kernels) against ATen's max_pool2d in float64:
// outputs, the one-byte index (ATen's int64 index mapped into the window) and gradients, exactly, over
// odd sizes, padding, overlapping windows, ties and NaN; bad arguments; and the model wiring
// (resnet's stem and the face detector with custom_pool: true vs false give the same outputs and
// gradients).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include "strobe/config/config.h"
#include "strobe/core/model.h"
#include "strobe/ops/ops.h"
#include "tests/ops/op_test_util.h"
#include "tests/models/model_test_util.h"

namespace {

using torch::Tensor;

struct PoolCase {
  std::vector<int64_t> shape, kernel, stride, padding;
};

std::tuple<Tensor, Tensor> fwd_op(const Tensor& x, const PoolCase& c) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::max_pool2d_fwd", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, at::IntArrayRef, at::IntArrayRef,
                                                               at::IntArrayRef)>();
  return op.call(x, c.kernel, c.stride, c.padding);
}

// ATen's flat int64 index (ih * W + iw) as the position inside the padded window.
Tensor window_position(const Tensor& aten_index, int64_t w, const PoolCase& c) {
  const int64_t kw = c.kernel.back(), sh = c.stride.empty() ? c.kernel[0] : c.stride[0];
  const int64_t sw = c.stride.empty() ? c.kernel.back() : c.stride.back(), ph = c.padding[0], pw = c.padding.back();
  const int64_t oh = aten_index.size(2), ow = aten_index.size(3);
  const Tensor h0 = torch::arange(oh).view({oh, 1}) * sh - ph, w0 = torch::arange(ow).view({1, ow}) * sw - pw;
  return ((torch::floor_divide(aten_index, w) - h0) * kw + (torch::remainder(aten_index, w) - w0)).to(torch::kByte);
}

const std::vector<PoolCase> kCases = {
    {{2, 3, 11, 9}, {3}, {2}, {1}},           // ResNet's stem window on odd sizes
    {{2, 4, 8, 8}, {2}, {2}, {0}},            // the detector's 2x2
    {{1, 3, 7, 5}, {2}, {2}, {0}},            // odd sizes: the last row / column belong to no window
    {{2, 2, 6, 7}, {3}, {1}, {1}},            // stride 1: every element in up to 9 windows
    {{1, 2, 9, 10}, {2, 3}, {1, 2}, {1, 1}},  // rectangular kernel, mixed strides
    {{1, 2, 12, 11}, {5}, {2}, {2}},          // larger window and padding
    {{2, 3, 4, 4}, {1}, {}, {0}},             // identity
    {{1, 1, 16, 16}, {16}, {}, {8}},          // 256-element window (the index limit), stride defaulted
};

TEST(MaxPool, CpuMatchesAtenExactlyInFloat64) {
  torch::manual_seed(0);
  for (const PoolCase& c : kCases) {
    for (const bool cl : {false, true}) {
      // Few distinct values: many ties inside windows (ATen keeps the first maximum).
      Tensor x = torch::randint(0, 4, c.shape, torch::kDouble);
      if (cl) x = x.contiguous(at::MemoryFormat::ChannelsLast);
      Tensor xa = x.clone().requires_grad_(), xs = x.clone().requires_grad_();
      auto [want, aten_index] = torch::max_pool2d_with_indices(xa, c.kernel, c.stride, c.padding);
      Tensor got = strobe::ops::max_pool2d(xs, c.kernel, c.stride, c.padding);
      const std::string tag = "shape " + c10::str(at::IntArrayRef(c.shape)) + " kernel " + c10::str(at::IntArrayRef(c.kernel)) + (cl ? " NHWC" : " NCHW");
      ASSERT_EQ(got.sizes(), want.sizes()) << tag;
      EXPECT_TRUE(torch::equal(got, want)) << tag;
      // (one channel: both layouts are the same memory)
      if (c.shape[1] > 1) EXPECT_EQ(got.is_contiguous(at::MemoryFormat::ChannelsLast), cl) << tag << ": keeps x's layout";
      auto [y, index] = fwd_op(x, c);
      EXPECT_TRUE(torch::equal(index, window_position(aten_index, c.shape[3], c))) << tag;
      Tensor gy = torch::randn(want.sizes(), torch::kDouble);
      want.backward(gy), got.backward(gy);
      EXPECT_TRUE(torch::equal(xs.grad(), xa.grad())) << tag << " max |diff| " << (xs.grad() - xa.grad()).abs().max();
      if (c.shape[1] > 1) EXPECT_EQ(xs.grad().is_contiguous(at::MemoryFormat::ChannelsLast), cl) << tag;
    }
  }
}

TEST(MaxPool, CpuOtherFloatTypesMatchAten) {
  torch::manual_seed(1);
  for (const auto dt : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    Tensor x = torch::randn({2, 8, 13, 13}).to(dt).contiguous(at::MemoryFormat::ChannelsLast);
    Tensor xa = x.clone().requires_grad_(), xs = x.clone().requires_grad_();
    Tensor want = torch::max_pool2d(xa, 3, 2, 1), got = strobe::ops::max_pool2d(xs, {3}, {2}, {1});
    EXPECT_TRUE(torch::equal(got, want)) << dt;
    Tensor gy = torch::randn(want.sizes()).to(dt);
    want.backward(gy), got.backward(gy);
    // our gather sums in fp32; ATen may round after each add: compare in float64
    EXPECT_LT((xs.grad().to(torch::kDouble) - xa.grad().to(torch::kDouble)).abs().max().item<double>(),
              dt == torch::kFloat ? 1e-6 : 2e-2)
        << dt;
  }
}

TEST(MaxPool, NaNPropagatesAndTakesTheGradientAsAten) {
  const PoolCase c{{1, 2, 6, 6}, {3}, {2}, {1}};
  Tensor x = torch::randn(c.shape, torch::kDouble);
  x[0][0][2][3] = NAN;  // in windows (1,1), (1,2) and overlaps
  x[0][1][1][1] = NAN, x[0][1][2][2] = NAN;  // two NaNs in one window: ATen's gradient goes to the last
  x[0][1][4][4] = INFINITY;
  Tensor xa = x.clone().requires_grad_(), xs = x.clone().requires_grad_();
  auto [want, aten_index] = torch::max_pool2d_with_indices(xa, c.kernel, c.stride, c.padding);
  Tensor got = strobe::ops::max_pool2d(xs, c.kernel, c.stride, c.padding);
  EXPECT_TRUE(got.isnan().equal(want.isnan()));
  EXPECT_GT(got.isnan().sum().item<int64_t>(), 3);
  EXPECT_TRUE(torch::equal(got.nan_to_num(0), want.nan_to_num(0)));
  EXPECT_TRUE(torch::equal(std::get<1>(fwd_op(x, c)), window_position(aten_index, 6, c)));
  Tensor gy = torch::randn(want.sizes(), torch::kDouble);
  want.backward(gy), got.backward(gy);
  EXPECT_TRUE(torch::equal(xs.grad(), xa.grad()));
  EXPECT_NE(xs.grad()[0][1][2][2].item<double>(), 0.0) << "the last NaN of the window takes the gradient";
}

TEST(MaxPool, PaddingNeverWins) {
  // All -inf: the padded positions (-inf too) must not be chosen; ATen picks the first in-image element.
  const PoolCase c{{1, 1, 5, 5}, {3}, {2}, {1}};
  Tensor x = torch::full(c.shape, -INFINITY, torch::kDouble);
  auto [want, aten_index] = torch::max_pool2d_with_indices(x, c.kernel, c.stride, c.padding);
  auto [got, index] = fwd_op(x, c);
  EXPECT_TRUE(torch::equal(got, want));
  EXPECT_TRUE(torch::equal(index, window_position(aten_index, 5, c)));
  EXPECT_EQ(index[0][0][0][0].item<int>(), 4) << "window (0, 0) starts in the padding: its first pixel is (1, 1)";
  // Negative values everywhere: a padded zero would win if padding were 0 instead of -inf.
  Tensor neg = -torch::rand(c.shape, torch::kDouble) - 1;
  EXPECT_TRUE(torch::equal(strobe::ops::max_pool2d(neg, {3}, {2}, {1}), torch::max_pool2d(neg, 3, 2, 1)));
}

using strobe::testing::expect_error;

TEST(MaxPool, BadArgumentsAreClearErrors) {
  const Tensor x = torch::randn({1, 2, 8, 8});
  expect_error([&] { strobe::ops::max_pool2d(x, {3}, {2}, {1}, {2}); }, "only dilation 1 is supported");
  expect_error([&] { strobe::ops::max_pool2d(x, {3}, {2}, {1}, {1}, true); }, "ceil_mode=True is not supported");
  expect_error([&] { strobe::ops::max_pool2d(torch::randn({1, 1, 40, 40}), {17}); }, "at most 256 elements");
  expect_error([&] { strobe::ops::max_pool2d(x, {3}, {2}, {2}); }, "padding must be between 0 and half the kernel size");
  expect_error([&] { strobe::ops::max_pool2d(x, {2}, {0}); }, "stride must be positive");
  expect_error([&] { strobe::ops::max_pool2d(x, {0}); }, "kernel_size must be positive");
  expect_error([&] { strobe::ops::max_pool2d(x, {2, 2, 2}); }, "kernel_size must be one int or two");
  expect_error([&] { strobe::ops::max_pool2d(torch::randn({2, 8, 8}), {2}); }, "x must be [N, C, H, W]");
  expect_error([&] { strobe::ops::max_pool2d(torch::ones({1, 1, 4, 4}, torch::kInt), {2}); }, "x must be floating point");
  expect_error([&] { strobe::ops::max_pool2d(torch::randn({1, 1, 2, 2}), {5}, {1}, {1}); }, "is smaller than the kernel");
}

// --- model wiring: custom_pool true (this op, its CPU kernel) vs false (ATen) -------------------------

std::shared_ptr<strobe::Model> resnet(const std::string& pool, const std::string& memory_format) {
  return strobe::testing::build_model("{name: resnet, depth: 18, width: 8, num_classes: 5, memory_format: " +
                                      memory_format + ", custom_pool: " + pool + "}");
}

void expect_same_training_step(strobe::Model& ours, strobe::Model& aten, const strobe::Batch& batch,
                               const std::function<Tensor(const Tensor&)>& loss) {
  strobe::testing::copy_weights(aten, ours);
  ours.train(), aten.train();
  const Tensor yo = ours.forward(batch), ya = aten.forward(batch);
  EXPECT_TRUE(torch::equal(yo, ya)) << "max |diff| " << (yo - ya).abs().max();
  ours.zero_grad(), aten.zero_grad();
  loss(yo).backward(), loss(ya).backward();
  auto pa = aten.named_parameters();
  int checked = 0;
  for (auto& kv : ours.named_parameters()) {
    EXPECT_TRUE(torch::equal(kv.value().grad(), pa[kv.key()].grad())) << kv.key();
    ++checked;
  }
  EXPECT_GT(checked, 3);
}

TEST(MaxPool, ResNetStemCustomPoolMatchesAten) {
  for (const std::string fmt : {"contiguous", "channels_last"}) {
    torch::manual_seed(3);
    auto ours = resnet("true", fmt), aten = resnet("false", fmt);
    ours->to(torch::kDouble), aten->to(torch::kDouble);
    const strobe::Batch batch = strobe::testing::image_batch(torch::randn({3, 3, 29, 27}, torch::kDouble));
    const Tensor target = torch::tensor({0, 1, 4});
    expect_same_training_step(*ours, *aten, batch,
                              [&](const Tensor& y) { return torch::nn::functional::cross_entropy(y, target); });
  }
}

TEST(MaxPool, FaceDetectorCustomPoolMatchesAten) {
  torch::manual_seed(4);
  const std::string yaml = "{name: face_detector, image_size: 32, max_boxes: 3, hidden_dim: 16, fused_conv: false, custom_pool: ";
  auto ours = strobe::testing::build_model(yaml + "true}"), aten = strobe::testing::build_model(yaml + "false}");
  ours->to(torch::kDouble), aten->to(torch::kDouble);
  const strobe::Batch batch = strobe::testing::image_batch(torch::rand({2, 1, 32, 32}, torch::kDouble));
  expect_same_training_step(*ours, *aten, batch, [](const Tensor& y) { return (y * y).sum(); });
}

TEST(MaxPool, CustomPoolKeyTakesAutoTrueFalseOnly) {
  for (const std::string yaml : {"{name: resnet, depth: 18, custom_pool: maybe}",
                                 "{name: face_detector, image_size: 32, hidden_dim: 8, custom_pool: sometimes}"}) {
    try {
      strobe::testing::build_model(yaml);
      ADD_FAILURE() << "accepted: " << yaml;
    } catch (const strobe::config::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("custom_pool"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(resnet("auto", "auto"));
}

}  // namespace
