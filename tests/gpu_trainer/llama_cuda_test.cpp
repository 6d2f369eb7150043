// The llama model through the trainer on CUDA (GQA 8 heads over 2, head_dim 64, tied embeddings,
// as configs/llama_1b.yaml at a smaller shape; the custom kernel takes head_dim 64 or 128 on CUDA):
// - CUDA graphs: on full fixed-length sequences a graphed bf16-master run gives the losses of an
//   eager one, on the sdpa and custom attention backends, with the fused LM head at a 32k vocabulary
//   and with trainer.fp8 (as close as a second eager run is);
// - bf16-master beside fp32, trainer.fp8 beside bf16-master, and the fused ops (strobe::add_rms_norm)
//   beside the ATen path: 100
//   steps on a learnable token file, the mean absolute difference of the two loss curves over the
//   last 50 steps below 2% of the loss, both learning;
// - NaN capture: an exploding learning rate stops the run with exit 3 and the capture replays
//   exactly on CUDA, naming the op that went non-finite and the norm it ran in.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>

#include <c10/cuda/CUDACachingAllocator.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/capture.h"
#include "runner/replay.h"
#include "tests/gpu_trainer/cuda_skip.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

constexpr const char* kLlamaModel =
    "{name: llama, vocab_size: 512, embed_dim: 512, depth: 2, num_heads: 8, num_kv_heads: 2, ffn_dim: 1024, "
    "max_seq_len: 128, rope_theta: 500000, tie_embeddings: true, attention: sdpa}";

std::string llama_yaml(const std::string& data, int64_t steps, const std::string& model = kLlamaModel) {
  return fmt::format(R"(name: llama_cuda
seed: 3
trainer:
  max_epochs: -1
  max_steps: {}
  precision: bf16-master
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  limit_val_batches: 0
  enable_progress_bar: false
  device: cuda
task: {{name: language_modeling}}
model: {}
data: {}
optimizer: {{name: adamw, lr: 1.0e-3, weight_decay: 0.1}}
scheduler: {{name: cosine, warmup_steps: 5}}
)",
                     steps, model, data);
}

constexpr const char* kFixedTokens =
    "{name: synthetic_tokens, vocab_size: 512, max_seq_len: 128, fixed_length: true, num_samples: 640, "
    "num_val_samples: 0, batch_size: 8, collate: pad_to_max, num_workers: 1, drop_last: true}";

std::vector<double> train_losses(const std::string& dir) {
  std::vector<double> out;
  for (auto& [step, row] : read_csv(dir + "/metrics.csv", "train/loss")) out.push_back(std::stod(row.at("train/loss")));
  return out;
}

// Documents of a learnable kind: each runs from a random start with a stride of 1, 2, 3 or 5 (mod the
// vocabulary), one token in ten replaced by a random one, ended by token 0. A model that learns the
// stride from a document's first tokens reaches a loss near the noise's floor (about 1).
std::string write_stride_documents(const std::string& dir, int64_t docs) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> start(1, 511), length(30, 127), stride_pick(0, 3), noise_tok(1, 511);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const int strides[] = {1, 2, 3, 5};
  std::vector<uint16_t> tokens;
  for (int64_t d = 0; d < docs; ++d) {
    const int s = start(rng), k = strides[stride_pick(rng)], n = length(rng);
    for (int i = 0; i < n; ++i) tokens.push_back(u(rng) < 0.1 ? noise_tok(rng) : 1 + (s - 1 + i * k) % 511);
    tokens.push_back(0);
  }
  const std::string path = dir + "/strides.bin";
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(uint16_t));
  return path;
}

}  // namespace

TEST(LlamaCuda, AGraphedRunGivesTheLossesOfAnEagerOneOnSdpaAndCustomAttention) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // The third: the fused LM head (strobe::linear_cross_entropy, its loss count on the device) at a
  // 32,768-token vocabulary, inside the graph.
  const std::vector<std::pair<std::string, std::vector<std::string>>> variants = {
      {"sdpa", {"model.attention=sdpa"}},
      {"custom", {"model.attention=custom"}},
      {"sdpa + fused head at 32k", {"model.attention=sdpa", "model.vocab_size=32768", "task.fused_linear_loss=true"}},
      // trainer.fp8: every decoder projection's GEMMs in float8, their scales computed inside the graph.
      {"sdpa + fp8", {"model.attention=sdpa", "trainer.fp8.min_size=0"}}};
  for (const auto& [backend, sets] : variants) {
    std::vector<double> runs[3];  // eager, eager again, graphed
    for (int r = 0; r < 3; ++r) {
      const bool graphed = r == 2;
      std::string dir = temp_dir("llama-graphs");
      auto overrides = sets;
      overrides.push_back(std::string("trainer.cuda_graphs=") + (graphed ? "true" : "false"));
      auto run = make_run(llama_yaml(kFixedTokens, 40), overrides, dir);
      ASSERT_EQ(run->trainer->fit(), 0) << backend << " run " << r;
      if (graphed) {
        EXPECT_EQ(run->trainer->graph_counts().captures, 1) << backend;
        EXPECT_EQ(run->trainer->graph_counts().replays, 37) << backend << ": 40 steps = 3 eager warm-up steps + 37 replays";
      }
      runs[r] = train_losses(dir);
      ASSERT_EQ(runs[r].size(), 40u) << backend;
      for (double l : runs[r]) ASSERT_TRUE(std::isfinite(l)) << backend << " run " << r;
    }
    auto worst = [](const std::vector<double>& a, const std::vector<double>& b) {
      double w = 0;
      for (size_t i = 0; i < a.size(); ++i) w = std::max(w, std::abs(a[i] - b[i]) / std::abs(a[i]));
      return w;
    };
    const double noise = worst(runs[0], runs[1]), graph = worst(runs[0], runs[2]);
    std::cout << "[ llama graphs ] " << backend << ": largest relative loss difference over 40 steps, eager vs eager "
              << noise << ", eager vs graphed " << graph << "\n";
    EXPECT_LE(graph, std::max(3 * noise, 1e-3)) << backend;
  }
}

// 100 steps of a 4-layer llama on learnable documents under `a` and under `b` (config overrides):
// the mean absolute difference of the two loss curves over steps 51-100 below 2% of the loss, both
// learning. Prints the curves' ends under `tag`.
void expect_curves_agree(const std::string& tag, const std::vector<std::string>& a, const std::vector<std::string>& b) {
  const std::string data_dir = temp_dir("llama-strides");
  const std::string path = write_stride_documents(data_dir, 4000);
  const std::string data = fmt::format(
      "{{name: token_file, path: {}, dtype: uint16, mode: documents, eot_token: 0, vocab_size: 512, max_seq_len: 128, "
      "val_fraction: 0.0, collate: pack, batch_size: 32, num_workers: 2}}",
      path);
  const std::string model =
      "{name: llama, vocab_size: 512, embed_dim: 512, depth: 4, num_heads: 8, num_kv_heads: 2, ffn_dim: 1376, "
      "max_seq_len: 128, rope_theta: 500000, tie_embeddings: true, attention: sdpa}";
  std::vector<double> curve[2];
  const std::vector<std::string>* sets[2] = {&a, &b};
  for (int i = 0; i < 2; ++i) {
    std::string dir = temp_dir("llama-curve");
    auto run = make_run(llama_yaml(data, 100, model), *sets[i], dir);
    ASSERT_EQ(run->trainer->fit(), 0) << tag << " run " << i;
    curve[i] = train_losses(dir);
    ASSERT_EQ(curve[i].size(), 100u) << tag << " run " << i;
  }
  double diff = 0, level = 0;
  for (size_t s = 50; s < 100; ++s) {
    diff += std::abs(curve[1][s] - curve[0][s]) / 50;
    level += curve[0][s] / 50;
  }
  std::cout << "[ llama " << tag << " ] loss " << curve[0].front() << " -> " << curve[0].back() << " and "
            << curve[1].front() << " -> " << curve[1].back() << "; mean difference over steps 51-100 " << diff << " = "
            << 100 * diff / level << "% of the loss (" << level << ")\n";
  EXPECT_LT(diff, 0.02 * level) << tag;
  for (int i = 0; i < 2; ++i) EXPECT_LT(curve[i].back(), 0.5 * curve[i].front()) << tag << " run " << i << " did not learn";
}

TEST(LlamaCuda, Bf16MasterTracksFp32Over100StepsOnLearnableDocuments) {
  SKIP_WITHOUT_CUDA_DEVICE();
  expect_curves_agree("precision: 32 vs bf16-master", {"trainer.precision=32"}, {"trainer.precision=bf16-master"});
}

// trainer.fp8 with every decoder projection in float8 (min_size 0) against bf16-master: the same
// training within the formats' noise.
TEST(LlamaCuda, Fp8TracksBf16MasterOver100StepsOnLearnableDocuments) {
  SKIP_WITHOUT_CUDA_DEVICE();
  expect_curves_agree("bf16-master vs fp8", {}, {"trainer.fp8.min_size=0"});
}

// The fused ops (strobe::add_rms_norm for every residual add + RMSNorm) against the ATen path, both
// bf16-master: the same training within bf16 noise.
TEST(LlamaCuda, FusedOpsTrackTheAtenPathOver100Steps) {
  SKIP_WITHOUT_CUDA_DEVICE();
  expect_curves_agree("fused_ops: false vs true", {"model.fused_ops=false"}, {"model.fused_ops=true"});
}

// With the fused ops the first non-finite op is the fused RMSNorm itself (docs/NAN_CAPTURE.md).
TEST(LlamaCuda, NanIsCapturedAndReplaysExactlyOnCuda) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const std::string fused : {"false", "true"})
  for (const char* precision : {"32", "bf16-master"}) {
    SCOPED_TRACE("fused_ops " + fused);
    std::string dir = temp_dir("llama-nan");
    auto run = make_run(llama_yaml(kFixedTokens, 20),
                        {std::string("trainer.precision=") + precision, "optimizer.lr=1e25", "callbacks=[{name: nan_capture}]",
                         "model.fused_ops=" + fused}, dir);
    ASSERT_EQ(run->trainer->fit(), 3) << precision;
    auto report = capture::replay_capture(dir + "/nan", {});
    EXPECT_TRUE(report["exact"].get<bool>()) << precision << "\n" << report.dump(2);
    ASSERT_FALSE(report["first_nonfinite"].is_null()) << report.dump(2);
    std::cout << "[ llama nan ] " << precision << ": first non-finite " << report["first_nonfinite"]["op"] << " in "
              << report["first_nonfinite"]["module"] << "\n";
    EXPECT_EQ(report["replayed_on"].get<std::string>().rfind("cuda", 0), 0u) << report.dump(2);
    const std::string op = report["first_nonfinite"]["op"], module = report["first_nonfinite"]["module"];
    if (fused == "false") {
      EXPECT_EQ(op, "aten::pow") << report.dump(2);
      EXPECT_EQ(module, "layers.0.input_layernorm") << report.dump(2);
    } else {
      // The fused forward's statistics overflow to a zero rstd (finite outputs); its backward is the
      // first op with a non-finite output, named with the norm it belongs to.
      EXPECT_EQ(op.rfind("strobe::add_rms_norm", 0), 0u) << report.dump(2);
      EXPECT_TRUE(module == "norm" || (module.rfind("layers.", 0) == 0 && module.size() > 9 &&
                                        module.compare(module.size() - 9, 9, "layernorm") == 0))
          << report.dump(2);
    }
  }
}

// trainer.fp8 (every decoder projection in float8): an exploding learning rate is captured, the
// capture replays exactly on CUDA (the tracer reads fp8_linear's float8 tensors) and runs on the
// CPU through the float8 op's CPU implementation, non-finite there too (the CPU runs the separate
// ATen ops where CUDA runs the fused norms, so it names the ATen op: docs/NAN_CAPTURE.md).
TEST(LlamaCuda, AnFp8NanCaptureReplaysExactlyOnCudaAndRunsOnTheCpu) {
  SKIP_WITHOUT_CUDA_DEVICE();
  std::string dir = temp_dir("llama-fp8-nan");
  {
    auto run = make_run(llama_yaml(kFixedTokens, 20),
                        {"trainer.fp8.min_size=0", "optimizer.lr=1e25", "callbacks=[{name: nan_capture}]"}, dir);
    ASSERT_EQ(run->trainer->fit(), 3);
  }
  auto report = capture::replay_capture(dir + "/nan", {});
  EXPECT_TRUE(report["exact"].get<bool>()) << report.dump(2);
  EXPECT_TRUE(report["fp8"].get<bool>());
  ASSERT_FALSE(report["first_nonfinite"].is_null()) << report.dump(2);
  capture::ReplayOptions on_cpu;
  on_cpu.device = "cpu";
  auto cpu = capture::replay_capture(dir + "/nan", on_cpu);
  EXPECT_EQ(cpu["replayed_on"], "cpu");
  ASSERT_FALSE(cpu["first_nonfinite"].is_null()) << cpu.dump(2);
  std::cout << "[ llama fp8 nan ] first non-finite on cuda " << report["first_nonfinite"]["op"] << " in "
            << report["first_nonfinite"]["module"] << ", on the cpu " << cpu["first_nonfinite"]["op"] << " in "
            << cpu["first_nonfinite"]["module"] << "\n";
  EXPECT_TRUE(cpu["fp8"].get<bool>());
  EXPECT_FALSE(cpu["nonfinite_grads"]["replayed"].empty()) << cpu.dump(2);
}

// What the custom kernels cannot run (head_dim 32; fp32 heads) is refused when the run is built,
// naming model.attention, instead of failing inside the first step.
TEST(LlamaCuda, CustomAttentionItsKernelsCannotRunIsAConfigErrorBeforeTraining) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const std::string hd32 =
      "{name: llama, vocab_size: 512, embed_dim: 256, depth: 2, num_heads: 8, num_kv_heads: 2, ffn_dim: 512, "
      "max_seq_len: 128, attention: custom}";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"model=" + hd32}, "custom on CUDA takes head_dim 64 or 128 (embed_dim / num_heads), this model's is 32"},
      {{"model.attention=custom", "trainer.precision=32"}, "trainer.precision 32 gives fp32 ones"},
  };
  for (const auto& [sets, message] : cases) {
    try {
      auto run = make_run(llama_yaml(kFixedTokens, 4), sets, temp_dir("llama-refused"));
      ADD_FAILURE() << "no error for " << message;
    } catch (const config::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

// model.activation_checkpointing: blocks on CUDA, bf16-master with the fused ops and the custom
// attention: eager and CUDA-graphed runs give the losses of a run without it (as close as a second
// run without it is), and blocks lowers the peak memory allocated over the run.
TEST(LlamaCuda, ActivationCheckpointingGivesTheSameLossesEagerAndGraphedWithLessMemory) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const torch::Device device(torch::kCUDA, 0);
  struct Variant {
    std::string name;
    std::vector<std::string> sets;
  };
  const std::vector<Variant> variants = {
      {"none", {"model.activation_checkpointing=none"}},
      {"none again", {"model.activation_checkpointing=none"}},
      {"blocks", {"model.activation_checkpointing=blocks"}},
      {"blocks graphed", {"model.activation_checkpointing=blocks"}},
      {"every_k 2", {"model.activation_checkpointing=every_k", "model.activation_checkpointing_every=2"}}};
  const std::string model =
      "{name: llama, vocab_size: 512, embed_dim: 512, depth: 4, num_heads: 8, num_kv_heads: 2, ffn_dim: 1024, "
      "max_seq_len: 128, rope_theta: 500000, tie_embeddings: true, attention: custom, fused_ops: true}";
  std::vector<std::vector<double>> losses;
  std::vector<double> peak;
  torch::zeros({1}, torch::kCUDA);  // the caching allocator exists before its statistics are read
  for (const auto& v : variants) {
    torch::cuda::synchronize();
    c10::cuda::CUDACachingAllocator::emptyCache();
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    std::string dir = temp_dir("llama-ac");
    auto sets = v.sets;
    sets.push_back("trainer.cuda_graphs=" + std::string(v.name == "blocks graphed" ? "true" : "false"));
    {
      auto run = make_run(llama_yaml(kFixedTokens, 20, model), sets, dir);
      ASSERT_EQ(run->trainer->fit(), 0) << v.name;
      if (v.name == "blocks graphed") EXPECT_EQ(run->trainer->graph_counts().captures, 1);
    }
    torch::cuda::synchronize();
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    peak.push_back(static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 20));
    losses.push_back(train_losses(dir));
    ASSERT_EQ(losses.back().size(), 20u) << v.name;
    for (double l : losses.back()) ASSERT_TRUE(std::isfinite(l)) << v.name;
  }
  auto worst = [&](size_t a, size_t b) {
    double w = 0;
    for (size_t i = 0; i < losses[a].size(); ++i) w = std::max(w, std::abs(losses[a][i] - losses[b][i]) / std::abs(losses[a][i]));
    return w;
  };
  const double noise = worst(0, 1);
  for (size_t i = 0; i < variants.size(); ++i)
    std::cout << "[ llama activation checkpointing ] " << variants[i].name << ": peak allocated " << peak[i]
              << " MiB, largest relative loss difference to none " << worst(0, i) << "\n";
  for (size_t i = 2; i < variants.size(); ++i) EXPECT_LE(worst(0, i), std::max(3 * noise, 1e-3)) << variants[i].name;
  // The run's peak (optimizer state, the checkpoint write) hides most of this small model's
  // activations; blocks must still lower it (every_k's peak is printed, not held: see
  // docs/PERFORMANCE.md for the full-size numbers).
  EXPECT_LT(peak[2], peak[0]) << "blocks keeps no less memory than none";
}
