// strobe::batch_norm_act on CPU (the reference of the CUDA kernels): forward, running statistics and
// every gradient against ATen's batch_norm + add + relu under autograd in float64; errors; and the
// ResNet wiring (fused_bn: true vs false give the same losses, gradients and running statistics).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/model.h"
#include "strobe/ops/ops.h"
#include "tests/models/model_test_util.h"

namespace {

using torch::Tensor;

struct BnCase {
  bool residual, relu;
};

TEST(BatchNormAct, MatchesAtenBatchNormAddReluForwardBackwardAndRunningStats) {
  torch::manual_seed(0);
  const auto opt = torch::TensorOptions().dtype(torch::kDouble);
  for (const BnCase c : {BnCase{false, true}, BnCase{true, true}, BnCase{false, false}, BnCase{true, false}}) {
    Tensor x = (torch::randn({3, 16, 5, 4}, opt) * 2 + 0.5).contiguous(at::MemoryFormat::ChannelsLast).requires_grad_();
    Tensor r = torch::randn({3, 16, 5, 4}, opt).requires_grad_();
    Tensor w = torch::rand({16}, opt).add_(0.5).requires_grad_(), b = torch::randn({16}, opt).requires_grad_();
    Tensor rm = torch::randn({16}, opt), rv = torch::rand({16}, opt).add_(0.5);
    Tensor rm2 = rm.clone(), rv2 = rv.clone();
    Tensor gy = torch::randn({3, 16, 5, 4}, opt);

    Tensor y = strobe::ops::batch_norm_act(x, w, b, rm, rv, c.residual ? std::optional<Tensor>(r) : std::nullopt,
                                           0.1, 1e-5, c.relu);
    auto g = torch::autograd::grad({y}, {x, w, b, r}, {gy}, /*retain_graph=*/false, false, /*allow_unused=*/true);

    Tensor x2 = x.detach().clone().requires_grad_(), r2 = r.detach().clone().requires_grad_();
    Tensor w2 = w.detach().clone().requires_grad_(), b2 = b.detach().clone().requires_grad_();
    Tensor want = torch::batch_norm(x2, w2, b2, rm2, rv2, /*training=*/true, 0.1, 1e-5, false);
    if (c.residual) want = want + r2;
    if (c.relu) want = torch::relu(want);
    auto g2 = torch::autograd::grad({want}, {x2, w2, b2, r2}, {gy}, false, false, true);

    EXPECT_TRUE(torch::allclose(y, want, 1e-10, 1e-10)) << c.residual << c.relu;
    EXPECT_TRUE(y.is_contiguous(at::MemoryFormat::ChannelsLast)) << "the output keeps x's layout";
    EXPECT_TRUE(torch::allclose(rm, rm2, 1e-12, 1e-12) && torch::allclose(rv, rv2, 1e-12, 1e-12));
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::allclose(g[i], g2[i], 1e-9, 1e-10)) << "grad " << i;
    if (c.residual) {
      EXPECT_TRUE(torch::allclose(g[3], g2[3], 1e-9, 1e-10));
    } else {
      EXPECT_FALSE(g[3].defined());
    }
  }
}

TEST(BatchNormAct, NaNInTheInputReachesTheOutput) {
  Tensor x = torch::randn({2, 8, 3, 3});
  x[1][3][2][2] = NAN;
  Tensor w = torch::ones({8}), b = torch::zeros({8}), rm = torch::zeros({8}), rv = torch::ones({8});
  Tensor y = strobe::ops::batch_norm_act(x, w, b, rm, rv);
  EXPECT_TRUE(y.select(1, 3).isnan().all().item<bool>()) << "the whole channel's statistics are NaN";
  EXPECT_FALSE(y.select(1, 2).isnan().any().item<bool>());
}

TEST(BatchNormAct, BadArgumentsAreClearErrors) {
  Tensor x = torch::randn({2, 8, 3, 3});
  Tensor w = torch::ones({8}), b = torch::zeros({8}), rm = torch::zeros({8}), rv = torch::ones({8});
  Tensor w4 = torch::ones({4});
  EXPECT_THROW(
      {
        try {
          strobe::ops::batch_norm_act(x, w4, b, rm, rv);
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("weight, bias and the running statistics must be floating [8]"), std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::Error);
  Tensor r = torch::randn({2, 8, 3, 2});
  EXPECT_THROW(strobe::ops::batch_norm_act(x, w, b, rm, rv, r), c10::Error);
  Tensor one = torch::randn({1, 8, 1, 1});
  EXPECT_THROW(strobe::ops::batch_norm_act(one, w, b, rm, rv), c10::Error);  // 1 value per channel
  EXPECT_THROW(strobe::ops::batch_norm_act(torch::randn({2, 8, 3}), w, b, rm, rv), c10::Error);
}

std::shared_ptr<strobe::Model> resnet(const std::string& fused) {
  return strobe::testing::build_model(
      "{name: resnet, depth: 50, width: 8, num_classes: 5, stem: cifar, memory_format: channels_last, fused_bn: " + fused + "}");
}

TEST(BatchNormAct, ResNetFusedBnKeyTakesAutoTrueFalseOnly) {
  try {
    resnet("maybe");
    ADD_FAILURE() << "fused_bn: maybe accepted";
  } catch (const strobe::config::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fused_bn"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(resnet("auto"));
}

TEST(BatchNormAct, ResNetFusedAndAtenPathsTrainAlike) {
  torch::manual_seed(3);
  auto fused = resnet("true"), aten = resnet("false");
  // float64: 50 layers of BatchNorm over a few values per channel amplify fp32 rounding differences
  fused->to(torch::kDouble), aten->to(torch::kDouble);
  strobe::testing::copy_weights(*aten, *fused);
  fused->train(), aten->train();
  strobe::Batch batch;
  batch.meta["batch_size"] = 4;
  batch.tensors["image"] = torch::randn({4, 3, 12, 12}, torch::kDouble);
  const Tensor target = torch::tensor({0, 1, 2, 3});
  for (int step = 0; step < 2; ++step) {
    Tensor lf = torch::nn::functional::cross_entropy(fused->forward(batch), target);
    Tensor la = torch::nn::functional::cross_entropy(aten->forward(batch), target);
    EXPECT_NEAR(lf.item<double>(), la.item<double>(), 1e-9);
    fused->zero_grad(), aten->zero_grad();
    lf.backward(), la.backward();
    auto pa = aten->named_parameters();
    for (auto& kv : fused->named_parameters())
      EXPECT_TRUE(torch::allclose(kv.value().grad(), pa[kv.key()].grad(), 1e-6, 1e-9)) << kv.key();
  }
  auto ba = aten->named_buffers();
  int checked = 0;
  for (auto& kv : fused->named_buffers()) {
    EXPECT_TRUE(torch::allclose(kv.value().to(torch::kDouble), ba[kv.key()].to(torch::kDouble), 1e-9, 1e-12)) << kv.key();
    ++checked;
  }
  EXPECT_GT(checked, 100) << "running_mean/var and num_batches_tracked of every BatchNorm";
  EXPECT_EQ(fused->named_buffers()["bn1.num_batches_tracked"].item<int64_t>(), 2);
}

}  // namespace
