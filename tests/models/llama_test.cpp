// llama (models/llama.h, models/llama_ops.h) on the CPU: the parameter set (tied head registered
// once), HF's rotary numerics (fp32 angles, rotate-half, Llama-3 scaling against an independent
// implementation), grouped-query attention equal to multi-head attention with K/V heads repeated in
// HF's order, padded = packed = per-sequence, causality, every backend alike, and the key checks.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/data/collate_tokens.h"
#include "models/llama.h"
#include "models/llama_ops.h"
#include "runner/experiment_builder.h"
#include "tests/models/model_test_util.h"

namespace {

using namespace strobe;
using strobe::testing::build_model;
using strobe::testing::count_parameters;
namespace lo = strobe::models::llama_ops;

std::string llama_yaml(const std::string& extra = "", int64_t heads = 4, int64_t kv_heads = 2) {
  return "name: llama\nvocab_size: 97\nembed_dim: 32\ndepth: 2\nnum_heads: " + std::to_string(heads) +
         "\nnum_kv_heads: " + std::to_string(kv_heads) + "\nffn_dim: 48\nmax_seq_len: 64\nrope_theta: 500000\n" + extra;
}

Batch tokens_batch(const torch::Tensor& tokens) {
  Batch b;
  b.tensors["tokens"] = tokens;
  b.meta["batch_size"] = tokens.size(0);
  return b;
}

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kDouble) - b.to(torch::kDouble)).norm() / b.to(torch::kDouble).norm().clamp_min(1e-30)).item<double>();
}

TEST(Llama, TiedHeadIsRegisteredOnceAndTheCountIsTheFormula) {
  const int64_t V = 97, C = 32, L = 2, H = 4, KV = 2, F = 48, hd = C / H;
  const int64_t per_layer = C * H * hd + 2 * C * KV * hd + H * hd * C + 3 * C * F + 2 * C;
  torch::manual_seed(0);
  auto tied = build_model(llama_yaml("tie_embeddings: true\n"));
  auto untied = build_model(llama_yaml());
  EXPECT_EQ(count_parameters(*tied), V * C + L * per_layer + C);
  EXPECT_EQ(count_parameters(*untied), 2 * V * C + L * per_layer + C);
  std::vector<std::string> names;
  for (const auto& p : tied->named_parameters()) names.push_back(p.key());
  EXPECT_EQ(std::count(names.begin(), names.end(), "embed_tokens.weight"), 1);
  EXPECT_EQ(std::find(names.begin(), names.end(), "lm_head.weight"), names.end());
  for (const char* n : {"layers.1.self_attn.q_proj.weight", "layers.1.self_attn.k_proj.weight", "layers.0.mlp.gate_proj.weight",
                        "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight", "norm.weight"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  EXPECT_TRUE(untied->named_parameters().contains("lm_head.weight"));
  EXPECT_EQ(tied->named_buffers().size(), 0u) << "the rotary frequencies are derived, not state";

  // The tied head's gradient is the sum of both uses, on the one tensor.
  auto tokens = torch::randint(1, V, {2, 7});
  auto logits = tied->forward(tokens_batch(tokens));
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, 7, V}));
  logits.sum().backward();
  const auto& w = tied->named_parameters()["embed_tokens.weight"];
  const auto unused = torch::ones({V}, torch::kBool).index_put_({tokens.flatten()}, torch::tensor(false));
  EXPECT_GT(w.grad().index({unused}).abs().sum().item<double>(), 0.0) << "rows of unseen tokens get the head's gradient";
}

TEST(Llama, RotaryFrequenciesAndAnglesAreHuggingFacesFp32) {
  const int64_t hd = 64;
  const double theta = 500000.0;
  auto inv = lo::rope_inv_freq(hd, theta, std::nullopt, torch::kCPU);
  ASSERT_EQ(inv.scalar_type(), torch::kFloat);
  for (int64_t i = 0; i < hd / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(hd);
    EXPECT_NEAR(inv[i].item<float>(), 1.0 / std::pow(theta, static_cast<double>(exponent)), 1e-6 * inv[i].item<float>()) << i;
  }
  // The angle is one fp32 product: at position 2047 it differs from the fp64 angle by up to ~1e-4
  // rad, so these tables follow the fp32 one (cos to 1e-6) and not the fp64 one.
  auto [cos, sin] = lo::rope_tables(torch::tensor({2047}, torch::kLong), inv);
  ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{1, hd}));
  double worst_fp64 = 0;
  for (int64_t i = 0; i < hd / 2; ++i) {
    const float angle32 = 2047.0f * inv[i].item<float>();
    const double angle64 = 2047.0 * (1.0 / std::pow(theta, 2.0 * i / hd));
    EXPECT_NEAR(cos[0][i].item<float>(), std::cos(static_cast<double>(angle32)), 1e-6) << i;
    EXPECT_NEAR(sin[0][i + hd / 2].item<float>(), std::sin(static_cast<double>(angle32)), 1e-6) << i;
    worst_fp64 = std::max(worst_fp64, std::abs(cos[0][i].item<float>() - std::cos(angle64)));
  }
  EXPECT_GT(worst_fp64, 1e-5) << "fp64 angles would pass too: the check would not see the difference";

  // rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) on the two halves of a head.
  auto x = torch::arange(1, 5, torch::kFloat).view({1, 1, 4});  // [T, H, D]
  auto c = torch::tensor({{0.5f, 0.25f, 0.5f, 0.25f}}), s = torch::tensor({{0.1f, 0.2f, 0.1f, 0.2f}});
  auto y = lo::apply_rotary(x, c, s);
  auto want = torch::tensor({1 * 0.5f - 3 * 0.1f, 2 * 0.25f - 4 * 0.2f, 3 * 0.5f + 1 * 0.1f, 4 * 0.25f + 2 * 0.2f}).view({1, 1, 4});
  EXPECT_TRUE(torch::allclose(y, want)) << y;
}

// Llama-3 scaling written out per frequency, in double (HF's _compute_llama3_parameters).
TEST(Llama, Llama3RopeScalingMatchesTheFormulaPerFrequency) {
  lo::Llama3RopeScaling s;  // factor 32, low 1, high 4, original 8192: Llama-3.2's
  const int64_t hd = 64;
  auto plain = lo::rope_inv_freq(hd, 500000.0, std::nullopt, torch::kCPU);
  auto scaled = lo::rope_inv_freq(hd, 500000.0, s, torch::kCPU);
  int kept = 0, divided = 0, blended = 0;
  for (int64_t i = 0; i < hd / 2; ++i) {
    const double f = plain[i].item<float>(), wavelen = 2 * M_PI / f;
    const double low_wavelen = 8192.0 / 1.0, high_wavelen = 8192.0 / 4.0;
    double want;
    if (wavelen < high_wavelen) {
      want = f, ++kept;
    } else if (wavelen > low_wavelen) {
      want = f / 32.0, ++divided;
    } else {
      const double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
      want = (1 - smooth) * f / 32.0 + smooth * f, ++blended;
    }
    EXPECT_NEAR(scaled[i].item<float>(), want, 2e-6 * want) << "frequency " << i;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0) << "all three bands must be exercised";
}

// math expands the K/V heads itself; sdpa takes them as they are (enable_gqa).
TEST(Llama, GroupedQueryAttentionIsMultiHeadWithKVHeadsRepeatedInHfOrder) {
  for (const std::string backend : {"math", "sdpa"}) {
  SCOPED_TRACE(backend);
  torch::manual_seed(1);
  auto gqa = build_model(llama_yaml("attention: " + backend + "\n"));
  auto mha = build_model(llama_yaml("attention: " + backend + "\n", 4, 4));
  auto g = gqa->named_parameters();
  torch::NoGradGuard no_grad;
  for (auto& p : mha->named_parameters()) {
    const std::string& n = p.key();
    if (n.find("k_proj") != std::string::npos || n.find("v_proj") != std::string::npos) {
      // [KV * hd, C] -> query head h reads K/V head h / 2: rows of head j repeated for heads 2j, 2j+1.
      auto w = g[n].view({2, 1, 8, 32}).expand({2, 2, 8, 32}).reshape({32, 32});
      p.value().copy_(w);
    } else {
      p.value().copy_(g[n]);
    }
  }
  auto tokens = torch::randint(1, 97, {3, 11});
  EXPECT_LT(rel_err(gqa->forward(tokens_batch(tokens)), mha->forward(tokens_batch(tokens))), 1e-6);
  // And it is not a no-op: K/V head order swapped gives other logits.
  auto k = mha->named_parameters()["layers.0.self_attn.k_proj.weight"];
  k.copy_(k.view({4, 8, 32}).flip(0).reshape({32, 32}));
  EXPECT_GT(rel_err(gqa->forward(tokens_batch(tokens)), mha->forward(tokens_batch(tokens))), 1e-3);
  }
}

// fused_ops: true runs every residual add and RMSNorm as strobe::add_rms_norm, the rotary embedding as
// strobe::rotary_qk and the MLP as one gate+up GEMM and strobe::swiglu (on the CPU the ops' ATen
// references, Hugging Face's sequence of ops): the ATen path's logits to 1e-6, padded and packed (the
// stacked GEMM may sum its dot products in another order, an fp32 rounding), and its gradients to 1e-5.
TEST(Llama, FusedOpsGiveTheAtenPathsLogitsAndGradients) {
  for (const std::string tie : {"false", "true"}) {
    SCOPED_TRACE("tie_embeddings " + tie);
    torch::manual_seed(4);
    auto aten = build_model(llama_yaml("fused_ops: false\ntie_embeddings: " + tie + "\n"));
    auto fused = build_model(llama_yaml("fused_ops: true\ntie_embeddings: " + tie + "\n"));
    strobe::testing::copy_weights(*aten, *fused);
    // Norm weights away from 1, so a weight applied in the wrong place shows.
    {
      torch::NoGradGuard no_grad;
      for (auto* m : {aten.get(), fused.get()})
        for (auto& p : m->named_parameters())
          if (p.key().find("norm") != std::string::npos) p.value().copy_(torch::linspace(0.5, 1.5, p.value().numel()));
    }
    // Packed documents (positions restart per document): the rotary tables have one row per token.
    auto samples = strobe::testing::token_samples({5, 13, 1, 9}, 97);
    auto packed = data::collate_tokens_packed(samples);
    {
      torch::NoGradGuard no_grad;
      EXPECT_LT(rel_err(fused->forward(packed), aten->forward(packed)), 1e-6);
    }
    const auto tokens = torch::randint(1, 97, {3, 11});
    const auto la = aten->forward(tokens_batch(tokens)), lf = fused->forward(tokens_batch(tokens));
    EXPECT_LT(rel_err(lf, la), 1e-6);
    const auto g = torch::randn(la.sizes());
    (la * g).sum().backward();
    (lf * g).sum().backward();
    auto fp = fused->named_parameters();
    for (const auto& p : aten->named_parameters()) {
      ASSERT_TRUE(fp[p.key()].grad().defined()) << p.key();
      EXPECT_LT(rel_err(fp[p.key()].grad(), p.value().grad()), 1e-5) << p.key();
    }
  }
}

TEST(Llama, PaddedPackedAndPerSequenceLogitsAgreeOnEveryBackendAndAreCausal) {
  torch::manual_seed(2);
  auto samples = strobe::testing::token_samples({5, 13, 1, 9}, 97);
  std::vector<torch::Tensor> alone;
  auto model = build_model(llama_yaml("rope_scaling: {rope_type: llama3, factor: 8, original_max_position_embeddings: 16}\n"));
  model->eval();
  torch::NoGradGuard no_grad;
  for (auto& s : samples) alone.push_back(model->forward(tokens_batch(s.at("tokens").unsqueeze(0))).squeeze(0));
  auto padded_samples = samples, packed_samples = samples;
  auto padded = data::collate_tokens_padded(padded_samples, 0);
  auto packed = data::collate_tokens_packed(packed_samples);
  for (const std::string backend : {"math", "sdpa", "custom"}) {
    torch::manual_seed(2);
    auto m = build_model(llama_yaml("rope_scaling: {rope_type: llama3, factor: 8, original_max_position_embeddings: 16}\n"
                                    "attention: " + backend + "\n"));
    strobe::testing::copy_weights(*model, *m);
    auto lp = m->forward(padded);
    auto lk = m->forward(packed);
    int64_t at = 0;
    for (size_t i = 0; i < samples.size(); ++i) {
      const int64_t n = alone[i].size(0);
      EXPECT_LT(rel_err(lp[i].narrow(0, 0, n), alone[i]), 1e-5) << backend << " padded, sequence " << i;
      EXPECT_LT(rel_err(lk.narrow(0, at, n), alone[i]), 1e-5) << backend << " packed, sequence " << i;
      at += n;
    }
  }
  // Causal: a later token changes no earlier logit.
  auto t = samples[1].at("tokens").unsqueeze(0).clone();
  auto before = model->forward(tokens_batch(t));
  t[0][8] = (t[0][8].item<int64_t>() % 96) + 1;
  auto after = model->forward(tokens_batch(t));
  EXPECT_TRUE(torch::equal(before.narrow(1, 0, 8), after.narrow(1, 0, 8)));
  EXPECT_FALSE(torch::equal(before.narrow(1, 8, 1), after.narrow(1, 8, 1)));
}

std::string error_of(const std::string& yaml) {
  try {
    build_model(yaml);
  } catch (const config::ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Llama, BadKeysAreConfigErrorsNamingThem) {
  const std::string kv = error_of(llama_yaml("", 4, 3));
  EXPECT_NE(kv.find("num_kv_heads: 3 does not divide num_heads (4)"), std::string::npos) << kv;
  const std::string heads = error_of(llama_yaml("", 5, 5));
  EXPECT_NE(heads.find("num_heads: 5 does not divide embed_dim (32)"), std::string::npos) << heads;
  const std::string odd = error_of("name: llama\nvocab_size: 97\nembed_dim: 12\nnum_heads: 4\nnum_kv_heads: 2\n");
  EXPECT_NE(odd.find("num_heads: gives head_dim = embed_dim / num_heads = 12 / 4 = 3, which is odd"), std::string::npos) << odd;
  const std::string rope = error_of(llama_yaml("rope_scaling: {rope_type: yarn}\n"));
  EXPECT_NE(rope.find("rope_scaling.rope_type"), std::string::npos) << rope;
  EXPECT_NE(rope.find("llama3"), std::string::npos) << rope;
  const std::string band = error_of(llama_yaml("rope_scaling: {low_freq_factor: 4, high_freq_factor: 1}\n"));
  EXPECT_NE(band.find("high_freq_factor: 1 must be above low_freq_factor (4)"), std::string::npos) << band;
  const std::string unknown = error_of(llama_yaml("attention_bias: true\n"));
  EXPECT_NE(unknown.find("attention_bias"), std::string::npos) << unknown;

  // A vocabulary smaller than the data's token ids is refused before training, naming both keys.
  auto doc = config::Document::load_string(llama_yaml(), "test.yaml");
  auto section = doc.root();
  model_registry().create(section, "");
  DataInfo info;
  info.vocab_size = 128, info.vocab_size_key = "vocab_size";
  try {
    check_data_fits_model(section, "synthetic_tokens", info);
    FAIL() << "a vocabulary of 97 for token ids up to 127 was accepted";
  } catch (const config::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("vocab_size: 97 tokens, but"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("data.vocab_size"), std::string::npos) << e.what();
  }
}

TEST(Llama, TheFfnRuleIsMetas) {
  EXPECT_EQ(models::llama_ffn_dim(4096), 11008);
  EXPECT_EQ(models::llama_ffn_dim(2048), 5632);
  auto m = build_model("name: llama\nvocab_size: 16\nembed_dim: 64\ndepth: 1\nnum_heads: 2\n");
  EXPECT_EQ(m->named_parameters()["layers.0.mlp.gate_proj.weight"].size(0), models::llama_ffn_dim(64));
}

}  // namespace
