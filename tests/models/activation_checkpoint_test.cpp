// model.activation_checkpointing (strobe/core/activation_checkpoint.h) on CPU: the gradients,
// losses and BatchNorm statistics are bitwise those of the model run without it, for every model
// that takes the key, on both the ATen and the fused paths; the checkpointed blocks keep no
// autograd graph of their own; the forward's autocast state and random numbers are what the
// recompute sees; bad values are config errors.
#include <functional>
#include <unordered_set>

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/activation_checkpoint.h"
#include "strobe/core/precision.h"
#include "strobe/data/collate_tokens.h"
#include "tests/models/model_test_util.h"
#include "tests/trainer/trainer_test_util.h"

namespace strobe {
namespace {

using testing::build_model;
using testing::copy_weights;

// The autograd graph reachable from `root`'s gradient function: its nodes (a checkpointed block is
// one), the checkpoints' nodes among them and the most activations (inputs that are not parameters)
// one of those keeps for its recompute.
struct GraphCounts {
  int64_t nodes = 0, checkpoints = 0, most_kept = 0;
};
GraphCounts count_graph(const torch::Tensor& root) {
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{root.grad_fn().get()};
  GraphCounts c;
  while (!todo.empty()) {
    auto* n = todo.back();
    todo.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    const bool checkpoint = n->name().find("CheckpointFunction") != std::string::npos;
    int64_t kept = 0;
    for (const auto& e : n->next_edges()) {
      todo.push_back(e.function.get());
      if (checkpoint && e.function && e.function->name().find("AccumulateGrad") == std::string::npos) ++kept;
    }
    if (checkpoint) {
      ++c.checkpoints;
      c.most_kept = std::max(c.most_kept, kept);
    }
  }
  c.nodes = static_cast<int64_t>(seen.size());
  return c;
}

struct StepResult {
  torch::Tensor loss;
  std::vector<std::pair<std::string, torch::Tensor>> grads, buffers;
  int64_t nodes = 0, checkpoints = 0, most_kept = 0;
};

// One forward and backward of `model` on `batch` against a fixed random projection of the output.
StepResult step(Model& model, const Batch& batch, const std::function<void()>& before_backward = {}) {
  model.zero_grad();
  torch::Tensor y = model.forward(batch);
  torch::manual_seed(99);
  const torch::Tensor loss = (y.to(torch::kFloat) * torch::randn(y.sizes())).sum();
  StepResult r;
  const GraphCounts g = count_graph(loss);
  r.nodes = g.nodes, r.checkpoints = g.checkpoints, r.most_kept = g.most_kept;
  if (before_backward) before_backward();
  loss.backward();
  r.loss = loss.detach();
  for (const auto& kv : model.named_parameters()) r.grads.emplace_back(kv.key(), kv.value().grad());
  for (const auto& kv : model.named_buffers()) r.buffers.emplace_back(kv.key(), kv.value().clone());
  return r;
}

void expect_bitwise(const StepResult& want, const StepResult& got, const std::string& what) {
  EXPECT_TRUE(torch::equal(want.loss, got.loss)) << what << ": loss " << want.loss.item<double>() << " vs "
                                                 << got.loss.item<double>();
  ASSERT_EQ(want.grads.size(), got.grads.size());
  for (size_t i = 0; i < want.grads.size(); ++i) {
    ASSERT_TRUE(got.grads[i].second.defined()) << what << ": no gradient for " << got.grads[i].first;
    EXPECT_TRUE(torch::equal(want.grads[i].second, got.grads[i].second))
        << what << ": " << want.grads[i].first << " differs by "
        << (want.grads[i].second - got.grads[i].second).abs().max().item<double>();
  }
  ASSERT_EQ(want.buffers.size(), got.buffers.size());
  for (size_t i = 0; i < want.buffers.size(); ++i)
    EXPECT_TRUE(torch::equal(want.buffers[i].second, got.buffers[i].second)) << what << ": buffer " << want.buffers[i].first;
}

// Runs the model as `base` + each checkpointing setting from the same weights: bitwise the same
// step; `blocks` keeps fewer graph nodes than none, and every_k in between; each checkpointed
// block keeps one activation (the fused paths' stream as one tensor, not res and pending).
void check_model(const std::string& base, const std::function<Batch()>& make_batch, const std::string& what) {
  torch::manual_seed(5);
  auto plain = build_model(base + "}");
  auto blocks = build_model(base + ", activation_checkpointing: blocks}");
  auto every2 = build_model(base + ", activation_checkpointing: every_k, activation_checkpointing_every: 2}");
  {
    // Non-trivial norm weights and biases (the defaults would hide a gradient routed to the wrong one).
    torch::NoGradGuard g;
    for (auto& kv : plain->named_parameters())
      if (kv.value().dim() == 1) kv.value().add_(torch::randn(kv.value().sizes()) * 0.1);
  }
  copy_weights(*plain, *blocks);
  copy_weights(*plain, *every2);
  const Batch batch = make_batch();
  const StepResult want = step(*plain, batch);
  const StepResult all = step(*blocks, batch);
  const StepResult half = step(*every2, batch);
  expect_bitwise(want, all, what + " blocks");
  expect_bitwise(want, half, what + " every_k 2");
  EXPECT_LT(all.nodes, half.nodes) << what;
  EXPECT_LT(half.nodes, want.nodes) << what;
  EXPECT_EQ(want.checkpoints, 0) << what;
  EXPECT_GE(all.checkpoints, 2) << what;
  EXPECT_EQ(half.checkpoints, (all.checkpoints + 1) / 2) << what;
  EXPECT_EQ(all.most_kept, 1) << what;
  EXPECT_EQ(half.most_kept, 1) << what;
}

Batch image(int64_t n, int64_t size) {
  torch::manual_seed(7);
  return testing::image_batch(torch::randn({n, 3, size, size}));
}

TEST(ActivationCheckpointing, VitGradientsAreBitwiseTheSameOnBothPaths) {
  for (const char* fused : {"false", "true"}) {
    check_model(std::string("{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 4, num_heads: 4, "
                            "fused_ops: ") + fused,
                [] { return image(3, 16); }, std::string("vit fused_ops ") + fused);
  }
}

TEST(ActivationCheckpointing, LlamaAndDecoderLmGradientsAreBitwiseTheSamePackedAndPadded) {
  for (const char* fused : {"false", "true"}) {
    for (const bool packed : {true, false}) {
      auto batch = [packed] {
        torch::manual_seed(8);
        std::vector<Sample> samples = testing::token_samples({5, 9, 2}, 50);
        return packed ? data::collate_tokens_packed(samples) : data::collate_tokens_padded(samples, 0);
      };
      const std::string how = std::string(" fused_ops ") + fused + (packed ? " packed" : " padded");
      check_model(std::string("{name: llama, vocab_size: 50, embed_dim: 32, depth: 4, num_heads: 4, num_kv_heads: 2, "
                              "max_seq_len: 16, fused_ops: ") + fused,
                  batch, "llama" + how);
      check_model(std::string("{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 4, num_heads: 4, "
                              "fused_ops: ") + fused,
                  batch, "decoder_lm" + how);
    }
  }
}

// The fused paths in bf16: a checkpointed block takes the residual stream as one tensor (the sum
// added before it), so its input gradient is the sum of the norm's and the residual's gradients,
// each rounded to bf16 (as on the ATen path), where the fused add and norm round their sum once: the
// forward is bitwise the same, and the gradients are no farther from those without checkpointing
// than the ATen path's are.
TEST(ActivationCheckpointing, FusedBf16BlocksGiveTheSameForwardAndGradientsWithinRounding) {
  // sqrt(sum |a - b|^2 / sum |a|^2) over every parameter's gradient.
  auto distance = [](const StepResult& a, const StepResult& b) {
    double d = 0, n = 0;
    for (size_t i = 0; i < a.grads.size(); ++i) {
      const auto x = a.grads[i].second.to(torch::kDouble), y = b.grads[i].second.to(torch::kDouble);
      EXPECT_TRUE(y.isfinite().all().item<bool>()) << b.grads[i].first;
      d += (x - y).pow(2).sum().item<double>();
      n += x.pow(2).sum().item<double>();
    }
    return std::sqrt(d / n);
  };
  for (const char* model : {"{name: llama, vocab_size: 50, embed_dim: 32, depth: 4, num_heads: 4, num_kv_heads: 2, "
                            "max_seq_len: 16",
                            "{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 4, num_heads: 4"}) {
    torch::manual_seed(5);
    auto plain = build_model(std::string(model) + ", fused_ops: true}");
    auto blocks = build_model(std::string(model) + ", fused_ops: true, activation_checkpointing: blocks}");
    auto aten = build_model(std::string(model) + ", fused_ops: false}");
    copy_weights(*plain, *blocks);
    copy_weights(*plain, *aten);
    for (auto* m : {plain.get(), blocks.get(), aten.get()}) m->to(torch::kBFloat16);
    torch::manual_seed(8);
    std::vector<Sample> samples = testing::token_samples({5, 9, 2}, 50);
    const Batch batch = data::collate_tokens_packed(samples);
    const StepResult want = step(*plain, batch), got = step(*blocks, batch), other = step(*aten, batch);
    ASSERT_EQ(want.grads.size(), got.grads.size());
    ASSERT_EQ(want.grads.size(), other.grads.size());
    EXPECT_TRUE(torch::equal(want.loss, got.loss)) << model;
    const double checkpointed = distance(want, got), aten_path = distance(want, other);
    EXPECT_GT(checkpointed, 0) << model;  // else the fused add and norm ran in the block: it kept two tensors
    EXPECT_LE(checkpointed, aten_path) << model;
    EXPECT_EQ(got.most_kept, 1) << model;
    std::cout << model << "}: gradients " << checkpointed << " from those without checkpointing, the ATen path's "
              << aten_path << "\n";
  }
}

// BatchNorm in training: the recompute normalises with the batch's statistics again but must not
// count the batch twice in the running statistics (compared through the buffers).
TEST(ActivationCheckpointing, ResNetGradientsAndBatchNormStatisticsAreBitwiseTheSame) {
  for (const char* fused : {"false", "true"}) {
    check_model(std::string("{name: resnet, depth: 18, width: 8, num_classes: 5, stem: cifar, fused_bn: ") + fused,
                [] { return image(4, 8); }, std::string("resnet fused_bn ") + fused);
  }
}

// bf16 autocast around the forward only, as the trainer runs it: the recompute in backward (outside
// the autocast region) must run under the forward's autocast state to give the same gradients.
TEST(ActivationCheckpointing, TheRecomputeRunsUnderTheForwardsAutocastState) {
  torch::manual_seed(6);
  const std::string base = "{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 2, num_heads: 4";
  auto plain = build_model(base + "}");
  auto ckpt = build_model(base + ", activation_checkpointing: blocks}");
  copy_weights(*plain, *ckpt);
  const Batch batch = image(2, 16);
  auto run = [&](Model& m) {
    m.zero_grad();
    torch::Tensor y;
    {
      AutocastGuard autocast(torch::kCPU, Precision::kBf16Mixed);
      y = m.forward(batch);
    }
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    y.to(torch::kFloat).sum().backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : m.parameters()) g.push_back(p.grad());
    return g;
  };
  const auto want = run(*plain), got = run(*ckpt);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::equal(want[i], got[i])) << i;
}

// A block of a user's model that draws random numbers (dropout) through the public API: with
// preserve_rng the recompute draws the forward's mask (bitwise the same gradients); without it the
// mask differs, which this test must see (else it could not tell the two apart).
TEST(ActivationCheckpointing, DropoutDrawsTheSameMaskInTheRecomputeOnlyWhenTheRngIsPreserved) {
  struct Block : torch::nn::Module {
    Block() { fc = register_module("fc", torch::nn::Linear(16, 16)); }
    torch::Tensor forward(const torch::Tensor& x) { return x + torch::dropout(torch::gelu(fc(x)), 0.5, true); }
    torch::nn::Linear fc{nullptr};
  };
  torch::manual_seed(3);
  auto block = std::make_shared<Block>();
  const torch::Tensor x0 = torch::randn({8, 16});
  auto run = [&](int mode) {  // 0 plain, 1 checkpointed with the RNG kept, 2 without
    block->zero_grad();
    auto x = x0.clone().requires_grad_(true);
    torch::manual_seed(11);
    torch::Tensor y;
    if (mode == 0) {
      y = block->forward(x);
    } else {
      y = checkpoint_block(*block, {x}, [block](const std::vector<torch::Tensor>& t) {
        return std::vector<torch::Tensor>{block->forward(t[0])};
      }, /*preserve_rng=*/mode == 1)[0];
    }
    torch::randn({100});  // the generator moves on between forward and backward, as a training step's would
    (y * y).sum().backward();
    return std::vector<torch::Tensor>{x.grad(), block->fc->weight.grad(), block->fc->bias.grad()};
  };
  const auto want = run(0), kept = run(1), lost = run(2);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::equal(want[i], kept[i])) << i;
  EXPECT_FALSE(torch::equal(want[1], lost[1]));
  // The generator is where the forward and the draw after it left it: the recompute forked it.
  torch::manual_seed(11);
  torch::dropout(torch::ones({8, 16}), 0.5, true);
  torch::randn({100});
  const torch::Tensor expected_next = torch::randn({4});
  torch::manual_seed(11);
  {
    auto x = x0.clone().requires_grad_(true);
    auto y = checkpoint_block(*block, {x}, [block](const std::vector<torch::Tensor>& t) {
      return std::vector<torch::Tensor>{block->forward(t[0])};
    })[0];
    torch::randn({100});
    y.sum().backward();
  }
  EXPECT_TRUE(torch::equal(torch::randn({4}), expected_next));
}

// Without gradients (validation, predict) a checkpointed model runs its blocks as they are.
TEST(ActivationCheckpointing, NoGradForwardIsThePlainForward) {
  auto m = build_model("{name: vit, img_size: 16, patch_size: 4, num_classes: 7, embed_dim: 32, depth: 2, num_heads: 4, "
                       "activation_checkpointing: blocks}");
  torch::NoGradGuard ng;
  const auto y = m->forward(image(2, 16));
  EXPECT_FALSE(y.requires_grad());
}

// Through the trainer: three AdamW steps of a llama under bf16-master (bf16 weights, fp32 masters)
// and of a resnet under bf16-mixed end on the same weights, bit for bit, with and without.
TEST(ActivationCheckpointing, TrainingEndsOnTheSameWeightsUnderBf16MasterAndBf16Mixed) {
  struct Case {
    std::string precision, model, data;
  };
  const std::vector<Case> cases = {
      {"bf16-master",
       "{name: llama, vocab_size: 64, embed_dim: 32, depth: 3, num_heads: 4, max_seq_len: 16}",
       "{name: synthetic_tokens, vocab_size: 64, max_seq_len: 16, num_samples: 64, num_val_samples: 8, batch_size: 4, "
       "num_workers: 1}"},
      {"bf16-mixed", "{name: resnet, depth: 18, width: 8, num_classes: 4, stem: cifar}",
       "{name: synthetic_images, image_size: 8, channels: 3, num_classes: 4, num_samples: 64, num_val_samples: 8, "
       "batch_size: 4, num_workers: 1}"}};
  for (const auto& c : cases) {
    auto yaml = [&](const std::string& ac) {
      std::string model = c.model;
      model.insert(model.size() - 1, ", activation_checkpointing: " + ac);
      return "name: ac\nseed: 4\ntrainer: {max_steps: 3, num_sanity_val_steps: 0, limit_val_batches: 0, "
             "enable_progress_bar: false, enable_model_summary: false, device: cpu, precision: " + c.precision + "}\nmodel: " + model + "\ndata: " +
             c.data + "\noptimizer: {name: adamw, lr: 0.01}\nscheduler: {name: none}\ncallbacks: []\n";
    };
    std::map<std::string, torch::Tensor> want;
    for (const char* ac : {"none", "blocks"}) {
      auto run = testing::make_run(yaml(ac), {}, "");
      ASSERT_EQ(run->trainer->fit(), 0) << c.precision << " " << ac;
      auto got = testing::params_of(*run->module);
      if (want.empty()) {
        want = got;
        for (const auto& [k, t] : want) ASSERT_TRUE(t.isfinite().all().item<bool>()) << k;
      } else {
        EXPECT_TRUE(testing::bitwise_equal(want, got)) << c.precision << ": the weights differ";
      }
    }
  }
}

TEST(ActivationCheckpointing, BadValuesAreConfigErrors) {
  auto expect_error = [](const std::string& yaml, const std::string& part) {
    try {
      build_model(yaml);
      ADD_FAILURE() << "accepted: " << yaml;
    } catch (const config::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  const std::string vit = "{name: vit, img_size: 16, patch_size: 4, embed_dim: 32, depth: 2, num_heads: 4, ";
  expect_error(vit + "activation_checkpointing: sometimes}", "activation_checkpointing");
  expect_error(vit + "activation_checkpointing: blocks, activation_checkpointing_every: 2}",
               "applies to activation_checkpointing: every_k, not blocks");
  expect_error(vit + "activation_checkpointing: every_k, activation_checkpointing_every: 0}", "activation_checkpointing_every");
  expect_error("{name: llama, vocab_size: 50, embed_dim: 32, depth: 2, num_heads: 4, activation_checkpointing: al}",
               "activation_checkpointing");
}

}  // namespace
}  // namespace strobe
