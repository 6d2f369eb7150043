// model.fused_ops (vit, decoder_lm) and task.fused_loss (classification, language_modeling) on CPU:
// the fused paths run the strobe ops' reference kernels and must give the same outputs, losses and
// gradients as the ATen paths, with the same parameter names; bad values are config errors.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/module.h"
#include "strobe/data/collate_tokens.h"
#include "tests/models/model_test_util.h"

namespace strobe {
namespace {

using testing::build_model;
using testing::copy_weights;

void expect_same_grads(Model& a, Model& b, double bound, const std::string& what) {
  auto ga = a.named_parameters();
  for (const auto& kv : b.named_parameters()) {
    const torch::Tensor want = ga[kv.key()].grad(), got = kv.value().grad();
    ASSERT_TRUE(got.defined() && want.defined()) << what << " " << kv.key();
    const double err = (got - want).norm().item<double>() / (want.norm().item<double>() + 1e-12);
    EXPECT_LT(err, bound) << what << " " << kv.key();
  }
}

TEST(TransformerFused, VitSameOutputsAndGradientsBothPoolings) {
  for (const char* pool : {"class_token: true, global_pool: token", "class_token: false, global_pool: avg"}) {
    torch::manual_seed(21);
    const std::string base = std::string("{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 3, "
                                         "num_heads: 4, ") + pool + ", fused_ops: ";
    auto aten = build_model(base + "false}");
    auto fused = build_model(base + "true}");
    ASSERT_EQ(aten->named_parameters().keys(), fused->named_parameters().keys());
    copy_weights(*aten, *fused);
    // Non-trivial LayerNorm parameters (the defaults 1 / 0 would hide a swapped weight or bias).
    {
      torch::NoGradGuard g;
      for (auto& kv : aten->named_parameters())
        if (kv.key().find("norm") != std::string::npos) kv.value().add_(torch::randn(kv.value().sizes()) * 0.1);
      copy_weights(*aten, *fused);
    }
    auto batch = testing::image_batch(torch::randn({3, 3, 16, 16}));
    const torch::Tensor ya = aten->forward(batch), yf = fused->forward(batch);
    EXPECT_TRUE(torch::allclose(yf, ya, 1e-5, 1e-5)) << pool;
    const torch::Tensor seed = torch::randn(ya.sizes());
    (ya * seed).sum().backward();
    (yf * seed).sum().backward();
    expect_same_grads(*aten, *fused, 1e-4, pool);
  }
}

TEST(TransformerFused, DecoderLmSameLossAndGradientsPackedAndPadded) {
  torch::manual_seed(22);
  const std::string base = "{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 3, num_heads: 4, fused_ops: ";
  auto aten = build_model(base + "false}");
  auto fused = build_model(base + "true}");
  ASSERT_EQ(aten->named_parameters().keys(), fused->named_parameters().keys());
  {
    torch::NoGradGuard g;
    for (auto& kv : aten->named_parameters())
      if (kv.key().find("norm") != std::string::npos) kv.value().add_(torch::randn(kv.value().sizes()) * 0.1);
  }
  copy_weights(*aten, *fused);
  std::vector<Sample> samples = testing::token_samples({5, 9, 2}, 50);
  for (const Batch& b : {data::collate_tokens_packed(samples), data::collate_tokens_padded(samples, 0)}) {
    aten->zero_grad();
    fused->zero_grad();
    const torch::Tensor ya = aten->forward(b), yf = fused->forward(b);
    EXPECT_TRUE(torch::allclose(yf, ya, 1e-5, 1e-5));
    const torch::Tensor seed = torch::randn(ya.sizes());
    (ya * seed).sum().backward();
    (yf * seed).sum().backward();
    expect_same_grads(*aten, *fused, 1e-4, "decoder_lm");
  }
}

std::shared_ptr<Module> build_task(const std::string& yaml, std::shared_ptr<Model> model) {
  auto doc = config::Document::load_string(yaml, "task.yaml");
  auto section = doc.root();
  return task_registry().create(section, "", model);
}

TEST(TransformerFused, FusedLossGivesTheSameLossAndGradients) {
  torch::manual_seed(23);
  // classification (vit) and language_modeling (decoder_lm), fused_loss true vs false.
  struct Case {
    std::string model, task;
  };
  auto vit = build_model("{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 1, num_heads: 4}");
  auto lm = build_model("{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 1, num_heads: 4}");
  Batch img = testing::image_batch(torch::randn({5, 3, 16, 16}));
  img.tensors["label"] = torch::randint(0, 7, {5}, torch::kLong);
  std::vector<Sample> samples = testing::token_samples({5, 9}, 50);
  const Batch tok = data::collate_tokens_padded(samples, 0);  // has -100 targets at the padding
  for (auto [model, name, batch] : {std::tuple{vit, std::string("classification"), img},
                                    std::tuple{lm, std::string("language_modeling"), tok}}) {
    auto on = build_task("{name: " + name + ", fused_loss: true}", model);
    auto off = build_task("{name: " + name + ", fused_loss: false}", model);
    model->zero_grad();
    const torch::Tensor lon = on->training_step(batch, 0);
    lon.backward();
    std::vector<torch::Tensor> g_on;
    for (auto& p : model->parameters()) g_on.push_back(p.grad().clone());
    model->zero_grad();
    const torch::Tensor loff = off->training_step(batch, 0);
    loff.backward();
    EXPECT_NEAR(lon.item<double>(), loff.item<double>(), 1e-6) << name;
    auto ps = model->parameters();
    for (size_t i = 0; i < ps.size(); ++i)
      EXPECT_TRUE(torch::allclose(g_on[i], ps[i].grad(), 1e-5, 1e-7)) << name << " param " << i;
  }
}

// task.fused_linear_loss: the head and the loss as strobe::linear_cross_entropy from the model's head
// input (never the logits) give the loss and every parameter's gradient of the logits path: llama
// (tied and untied head, padded and packed) and decoder_lm (a head with a bias); validation too. auto
// keeps the logits path on the CPU. `true` with a model without such a head is a config error naming
// the key.
TEST(TransformerFused, FusedLinearLossGivesTheSameLossAndGradients) {
  torch::manual_seed(25);
  std::vector<Sample> samples = testing::token_samples({5, 9, 3}, 50);
  auto padded_samples = samples, packed_samples = samples;
  const Batch padded = data::collate_tokens_padded(padded_samples, 0), packed = data::collate_tokens_packed(packed_samples);
  for (const std::string model : {"{name: llama, vocab_size: 50, embed_dim: 32, depth: 2, num_heads: 4, num_kv_heads: 2, "
                                  "ffn_dim: 48, max_seq_len: 16, tie_embeddings: true}",
                                  "{name: llama, vocab_size: 50, embed_dim: 32, depth: 1, num_heads: 4, ffn_dim: 48, "
                                  "max_seq_len: 16}",
                                  "{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 1, num_heads: 4}"}) {
    auto net = build_model(model);
    auto on = build_task("{name: language_modeling, fused_linear_loss: true}", net);
    auto off = build_task("{name: language_modeling, fused_linear_loss: false}", net);
    for (const Batch* batch : {&padded, &packed}) {
      SCOPED_TRACE(model + (batch == &packed ? " packed" : " padded"));
      net->zero_grad();
      const torch::Tensor lon = on->training_step(*batch, 0);
      lon.backward();
      std::vector<torch::Tensor> g_on;
      for (auto& p : net->parameters()) g_on.push_back(p.grad().clone());
      net->zero_grad();
      const torch::Tensor loff = off->training_step(*batch, 0);
      loff.backward();
      EXPECT_NEAR(lon.item<double>(), loff.item<double>(), 1e-6 * std::abs(loff.item<double>()));
      auto ps = net->named_parameters();
      size_t i = 0;
      for (auto& p : ps) {
        EXPECT_TRUE(torch::allclose(g_on[i], p.value().grad(), 1e-4, 1e-7)) << p.key();
        ++i;
      }
    }
  }
  {  // auto keeps the logits path on the CPU, at any vocabulary (the GPU test covers CUDA's rule)
    auto net = build_model("{name: llama, vocab_size: 40000, embed_dim: 16, depth: 1, num_heads: 2, ffn_dim: 24, max_seq_len: 16}");
    std::vector<Sample> big = testing::token_samples({7, 4}, 40000);
    const Batch b = data::collate_tokens_packed(big);
    const torch::Tensor la = build_task("{name: language_modeling}", net)->training_step(b, 0);
    const torch::Tensor lf = build_task("{name: language_modeling, fused_linear_loss: false}", net)->training_step(b, 0);
    EXPECT_TRUE(torch::equal(la, lf));
    // auto with a model that has no such head is not an error.
    build_task("{name: language_modeling, fused_linear_loss: auto}",
               build_model("{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 1, num_heads: 4}"));
  }
  try {
    build_task("{name: language_modeling, fused_linear_loss: true}",
               build_model("{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 1, num_heads: 4}"));
    ADD_FAILURE() << "no error";
  } catch (const config::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fused_linear_loss: needs a model that hands its head's input to the loss"),
              std::string::npos)
        << e.what();
  }
}

TEST(TransformerFused, GeluTanhFusedMlpMatchesAtenAndDiffersFromErf) {
  for (const char* model : {"{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 2, num_heads: 4",
                            "{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 2, num_heads: 4"}) {
    torch::manual_seed(24);
    const std::string base(model);
    auto aten = build_model(base + ", gelu: tanh, fused_ops: false}");
    auto fused = build_model(base + ", gelu: tanh, fused_ops: true}");
    auto erf = build_model(base + ", fused_ops: false}");
    copy_weights(*aten, *fused);
    copy_weights(*aten, *erf);
    Batch b;
    if (base.find("vit") != std::string::npos) {
      b = testing::image_batch(torch::randn({2, 3, 16, 16}));
    } else {
      std::vector<Sample> samples = testing::token_samples({6, 3}, 50);
      b = data::collate_tokens_packed(samples);
    }
    const torch::Tensor ya = aten->forward(b), yf = fused->forward(b), ye = erf->forward(b);
    EXPECT_TRUE(torch::allclose(yf, ya, 1e-5, 1e-5)) << base;
    EXPECT_FALSE(torch::allclose(ye, ya, 1e-6, 1e-6)) << base << ": gelu: tanh changed nothing";
    const torch::Tensor seed = torch::randn(ya.sizes());
    (ya * seed).sum().backward();
    (yf * seed).sum().backward();
    expect_same_grads(*aten, *fused, 1e-4, base);
  }
  EXPECT_THROW(build_model("{name: vit, img_size: 16, patch_size: 4, gelu: exact}"), config::ConfigError);
}

// Under autocast (bf16-mixed) the residual stream is fp32 while the projections return bf16: the
// fused path must promote like ATen's `x + delta` (CPU autocast reproduces the mix).
TEST(TransformerFused, AutocastMixedDtypesMatchAten) {
  for (const char* model : {"{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 2, num_heads: 4",
                            "{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 2, num_heads: 4"}) {
    torch::manual_seed(25);
    const std::string base(model);
    auto aten = build_model(base + ", fused_ops: false}");
    auto fused = build_model(base + ", fused_ops: true}");
    copy_weights(*aten, *fused);
    Batch b;
    if (base.find("vit") != std::string::npos) {
      b = testing::image_batch(torch::randn({2, 3, 16, 16}));
    } else {
      std::vector<Sample> samples = testing::token_samples({6, 3}, 50);
      b = data::collate_tokens_packed(samples);
    }
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    torch::Tensor ya, yf;
    try {
      ya = aten->forward(b).to(torch::kFloat);
      yf = fused->forward(b).to(torch::kFloat);
    } catch (...) {
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
      throw;
    }
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    const double err = (yf - ya).norm().item<double>() / ya.norm().item<double>();
    EXPECT_LT(err, 2e-2) << base;
  }
}

TEST(TransformerFused, BadKeysAreConfigErrors) {
  EXPECT_THROW(build_model("{name: vit, img_size: 16, patch_size: 4, fused_ops: yes_please}"), config::ConfigError);
  EXPECT_THROW(build_model("{name: decoder_lm, fused_ops: 2}"), config::ConfigError);
  auto vit = build_model("{name: vit, img_size: 16, patch_size: 4, embed_dim: 32, depth: 1, num_heads: 4}");
  EXPECT_THROW(build_task("{name: classification, fused_loss: maybe}", vit), config::ConfigError);
  EXPECT_THROW(build_task("{name: classification, fused_loss: true, label_smoothing: 0.1}", vit), config::ConfigError);
  EXPECT_THROW(build_task("{name: classification, fused_loss: true, loss: per_class_bce}", vit), config::ConfigError);
  EXPECT_NO_THROW(build_task("{name: classification, fused_loss: auto, label_smoothing: 0.1}", vit));
}

}  // namespace
}  // namespace strobe
