// trainer.fp8 on the CPU (ATen's float8 GEMMs): strobe::linear takes the float8 path exactly for the
// layers a trainer marked (and under autocast as at::linear would), the selection over a model's
// float8-capable layers (skip, min_size, the multiple-of-16 rule), the refusals before training, and
// a small Llama trained in float8 against bf16-master: close, not the same, resumable either way.
#include <gtest/gtest.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <fstream>
#include <sstream>

#include "strobe/core/fp8.h"
#include "strobe/ops/ops.h"
#include "tests/source_path.h"
#include "tests/trainer/trainer_test_util.h"

namespace {

using strobe::Fp8Choice;
using strobe::Fp8Layers;
using strobe::testing::make_run;
using strobe::testing::source_path;
using strobe::testing::temp_dir;

std::string llama_yaml() {
  std::ifstream in(source_path("configs/cpu/llama_1b.yaml"));
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string config_error(const std::vector<std::string>& sets, const std::string& yaml = llama_yaml()) {
  try {
    make_run(yaml, sets, "");
  } catch (const strobe::config::ConfigError& e) {
    return e.what();
  }
  return "";
}

// The verdict of each capable layer, "path=float8" or "path=<why not>".
std::vector<std::string> verdicts(const strobe::Run& run) {
  const Fp8Layers* f = strobe::fp8_layers_of(run.module->net());
  std::vector<std::string> out;
  if (!f) return out;
  for (const auto& c : f->choices()) out.push_back(c.path + "=" + (c.fp8 ? "float8" : c.why_not));
  return out;
}

TEST(Fp8Trainer, AMarkedLayerRunsTheFloat8OpAndEveryOtherAtLinear) {
  torch::manual_seed(0);
  torch::nn::Linear layer(torch::nn::LinearOptions(64, 32).bias(true));
  const torch::Tensor x = torch::randn({5, 7, 64});
  const torch::Tensor plain = at::linear(x, layer->weight, layer->bias);
  EXPECT_TRUE(torch::equal(strobe::linear(layer, x), plain)) << "an unmarked layer is at::linear";
  {
    Fp8Choice c;
    c.path = "fc", c.layer = layer.get(), c.out_features = 32, c.in_features = 64, c.fp8 = true;
    Fp8Layers marks(*layer, {c});
    EXPECT_TRUE(strobe::fp8_marked(*layer));
    const torch::Tensor y = strobe::linear(layer, x);
    EXPECT_TRUE(torch::equal(y, strobe::ops::fp8_linear(x, layer->weight, layer->bias)));
    EXPECT_FALSE(torch::equal(y, plain)) << "the float8 path rounds its operands";
    EXPECT_LT((y - plain).norm().item<double>() / plain.norm().item<double>(), 0.06);
    {
      // Under autocast the GEMM's inputs are the autocast dtype's, as at::linear's are.
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      const torch::Tensor ya = strobe::linear(layer, x);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      EXPECT_EQ(ya.scalar_type(), torch::kBFloat16);
      EXPECT_TRUE(torch::equal(ya, strobe::ops::fp8_linear(x.to(torch::kBFloat16), layer->weight,
                                                           layer->bias.to(torch::kBFloat16))));
    }
    torch::nn::Linear other(torch::nn::LinearOptions(64, 32).bias(false));
    EXPECT_TRUE(torch::equal(strobe::linear(other, x), at::linear(x, other->weight)));
  }
  EXPECT_FALSE(strobe::fp8_marked(*layer)) << "the marks end with the selection that made them";
  EXPECT_TRUE(torch::equal(strobe::linear(layer, x), plain));
}

TEST(Fp8Trainer, SelectsTheModelsBodyBySkipMinSizeAndTheMultipleOf16) {
  // embed 64, ffn 200 (not a multiple of 16): q/o 64 x 64 = 4096, k/v 32 x 64, gate/up/down 200 wide.
  auto run = make_run(llama_yaml(),
                      {"trainer.precision=bf16-master", "trainer.fp8.min_size=4096", "trainer.fp8.skip=[\"layers.1.*.o_proj\"]",
                       "model.ffn_dim=200"},
                      "");
  const std::vector<std::string> want = {
      "layers.0.self_attn.q_proj=float8",     "layers.0.self_attn.k_proj=below min_size",
      "layers.0.self_attn.v_proj=below min_size", "layers.0.self_attn.o_proj=float8",
      "layers.0.mlp.gate_proj=not a multiple of 16", "layers.0.mlp.up_proj=not a multiple of 16",
      "layers.0.mlp.down_proj=not a multiple of 16", "layers.1.self_attn.q_proj=float8",
      "layers.1.self_attn.k_proj=below min_size", "layers.1.self_attn.v_proj=below min_size",
      "layers.1.self_attn.o_proj=skip",        "layers.1.mlp.gate_proj=not a multiple of 16",
      "layers.1.mlp.up_proj=not a multiple of 16", "layers.1.mlp.down_proj=not a multiple of 16"};
  EXPECT_EQ(verdicts(*run), want) << "not the embedding nor the tied head; every decoder projection judged";
  const Fp8Layers* f = strobe::fp8_layers_of(run->module->net());
  ASSERT_TRUE(f);
  EXPECT_EQ(f->summary(),
            "3 of 14 float8-capable linear layers in float8: layers.*.self_attn.q_proj x2, layers.*.self_attn.o_proj; kept: "
            "layers.*.self_attn.k_proj x2 (below min_size), layers.*.self_attn.v_proj x2 (below min_size), "
            "layers.*.mlp.gate_proj x2 (not a multiple of 16), layers.*.mlp.up_proj x2 (not a multiple of 16), "
            "layers.*.mlp.down_proj x2 (not a multiple of 16), layers.*.self_attn.o_proj (skip)");
  run.reset();
  // vit: its blocks' four linear layers, not the patch embedding or the head.
  auto vit = make_run(llama_yaml(),
                      {"trainer.precision=bf16-mixed", "trainer.fp8.min_size=0", "model={name: vit, img_size: 16, patch_size: 8, "
                       "embed_dim: 32, depth: 1, num_heads: 2, num_classes: 16}",
                       "task={name: classification}", "data={name: synthetic_images, image_size: 16, channels: 3, num_classes: 16, "
                       "num_samples: 8, batch_size: 4}"},
                      "");
  EXPECT_EQ(verdicts(*vit), (std::vector<std::string>{"blocks.0.qkv=float8", "blocks.0.proj=float8", "blocks.0.fc1=float8",
                                                      "blocks.0.fc2=float8"}));
}

TEST(Fp8Trainer, RefusesBeforeTrainingWithOneLine) {
  EXPECT_EQ(config_error({"trainer.fp8=true"}),
            "trainer.fp8: needs trainer.precision bf16-master or bf16-mixed (the float8 GEMMs' outputs are bf16), got 32");
  EXPECT_EQ(config_error({"trainer.precision=bf16-master", "trainer.fp8=true"}),
            "trainer.fp8: no linear layer of model 'llama' runs in float8: of its 14 float8-capable layers the largest, "
            "layers.0.mlp.gate_proj (256 x 64 = 16384 elements), is below min_size (trainer.fp8.min_size is 3145728; 0 puts "
            "every capable layer in float8)");
  EXPECT_EQ(config_error({"trainer.precision=bf16-master", "trainer.fp8.skip=[\"layers.*.k_pro\"]"}),
            "trainer.fp8.skip: 'layers.*.k_pro' matches none of the 14 float8-capable linear layers of model 'llama' (e.g. "
            "layers.0.self_attn.q_proj)");
  EXPECT_EQ(config_error({"trainer.precision=bf16-master", "trainer.fp8=true"}, strobe::testing::tiny_yaml()),
            "trainer.fp8: model 'mlp' declares no linear layers that run in float8 (llama, vit and decoder_lm do)");
  EXPECT_EQ(config_error({"trainer.precision=bf16-master", "trainer.fp8=false"}), "") << "enabled: false is off";
  // A GPU without float8 GEMMs (the check the trainer makes on a CUDA device, here on its inputs).
  EXPECT_EQ(strobe::fp8_device_refusal("cuda:0", "NVIDIA A100-SXM4-80GB", 8, 0),
            "trainer.fp8: device cuda:0 (NVIDIA A100-SXM4-80GB) has compute capability 8.0; float8 GEMMs need 8.9 (Ada) "
            "or 9.0+ (Hopper)");
  EXPECT_EQ(strobe::fp8_device_refusal("cuda:1", "NVIDIA L40S", 8, 9), "");
  EXPECT_EQ(strobe::fp8_device_refusal("cuda:0", "NVIDIA H200", 9, 0), "");
}

TEST(Fp8Trainer, ALlamaTrainsInFloat8CloseToBf16MasterAndResumesEitherWay) {
  // 10 steps, resumed to 13 and 16: lean (every run is a CPU float8 GEMM's worth of steps).
  const std::vector<std::string> base = {"trainer.precision=bf16-master", "optimizer.lr=0.01", "trainer.log_every_n_steps=1",
                                         "trainer.enable_progress_bar=false", "trainer.max_steps=10",
                                         "trainer.memory_check=false", "trainer.num_sanity_val_steps=0"};
  auto sets = [&](std::vector<std::string> more) {
    more.insert(more.begin(), base.begin(), base.end());
    return more;
  };
  const std::string bf16_dir = temp_dir("fp8-bf16"), fp8_dir = temp_dir("fp8-on");
  auto bf16 = make_run(llama_yaml(), sets({}), bf16_dir);
  ASSERT_EQ(bf16->trainer->fit(), 0);
  auto fp8 = make_run(llama_yaml(), sets({"trainer.fp8.min_size=0"}), fp8_dir);
  ::testing::internal::CaptureStdout();
  const int fp8_exit = fp8->trainer->fit();
  const std::string fp8_out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(fp8_exit, 0);
  EXPECT_NE(fp8_out.find("strobe fit: trainer.fp8: 14 of 14 float8-capable linear layers in float8: "
                         "layers.*.self_attn.q_proj x2, "),
            std::string::npos)
      << "the run's start names the layers: " << fp8_out;
  const auto a = strobe::testing::read_csv(bf16_dir + "/metrics.csv", "train/loss");
  const auto b = strobe::testing::read_csv(fp8_dir + "/metrics.csv", "train/loss");
  ASSERT_EQ(a.size(), 10u);
  ASSERT_EQ(b.size(), 10u);
  double worst = 0;
  int same = 0;
  for (const auto& [step, row] : a) {
    const double la = std::stod(row.at("train/loss")), lb = std::stod(b.at(step).at("train/loss"));
    worst = std::max(worst, std::abs(la - lb) / la);
    same += row.at("train/loss") == b.at(step).at("train/loss");
  }
  EXPECT_LT(worst, 0.01) << "every step's loss within 1% of bf16-master's";
  EXPECT_LT(same, 10) << "float8 GEMMs round: the losses are not bf16's bit for bit";
  EXPECT_FALSE(strobe::testing::bitwise_equal(strobe::testing::params_of(*bf16->module),
                                              strobe::testing::params_of(*fp8->module)));
  std::ifstream summary(fp8_dir + "/model_summary.txt");
  std::stringstream text;
  text << summary.rdbuf();
  EXPECT_NE(text.str().find("layers.1.mlp.down_proj    |       64 x 256 | float8"), std::string::npos) << text.str();
  fp8.reset();

  // Turning float8 on at a resume (and off again) is an ordinary change: the steps continue.
  const std::string on_dir = temp_dir("fp8-resume-on"), off_dir = temp_dir("fp8-resume-off");
  auto on = make_run(llama_yaml(), sets({"trainer.fp8.min_size=0", "trainer.max_steps=13"}), on_dir,
                     bf16_dir + "/checkpoints/last.ckpt");
  ASSERT_EQ(on->trainer->fit(std::move(on->checkpoint)), 0);
  EXPECT_EQ(on->trainer->view().state().global_step, 13);
  on.reset();
  auto off = make_run(llama_yaml(), sets({"trainer.max_steps=16"}), off_dir,
                      on_dir + "/checkpoints/last.ckpt");
  ASSERT_EQ(off->trainer->fit(std::move(off->checkpoint)), 0);
  EXPECT_EQ(off->trainer->view().state().global_step, 16);
  EXPECT_EQ(strobe::fp8_layers_of(off->module->net()), nullptr);
}

// llama's fused path runs gate and up as one GEMM: float8 only when both halves are selected (a
// skipped gate keeps the GEMM in bf16, as skipping both does); the separate path runs up in float8.
TEST(Fp8Trainer, LlamasFusedGateUpGemmIsFloat8OnlyWhenBothHalvesAre) {
  auto logits = [](const std::string& fused, const std::string& skip) {
    auto run = make_run(llama_yaml(), {"trainer.precision=bf16-master", "trainer.fp8.min_size=0", "model.fused_ops=" + fused,
                                       "trainer.fp8.skip=" + skip},
                        "");
    strobe::Batch b;
    b["tokens"] = torch::arange(32, torch::kLong).reshape({2, 16}) * 7 % 512;
    torch::NoGradGuard no_grad;
    return dynamic_cast<strobe::Model&>(run->module->net()).forward(b);
  };
  const std::string gate = "[\"*.gate_proj\"]", both = "[\"*.gate_proj\", \"*.up_proj\"]", k = "[\"*.k_proj\"]";
  EXPECT_TRUE(torch::equal(logits("true", gate), logits("true", both))) << "fused: a skipped gate keeps gate+up in bf16";
  EXPECT_FALSE(torch::equal(logits("true", gate), logits("true", k))) << "fused: both selected, gate+up in float8";
  EXPECT_FALSE(torch::equal(logits("false", gate), logits("false", both))) << "separate: up alone in float8";
}

// Activation checkpointing's recompute quantizes the same values with the same scales: a float8
// run ends on bitwise the weights of one without it.
TEST(Fp8Trainer, ActivationCheckpointingEndsOnBitwiseTheWeightsOfARunWithoutIt) {
  std::map<std::string, torch::Tensor> params[2];
  for (int i = 0; i < 2; ++i) {
    auto run = make_run(llama_yaml(),
                        {"trainer.precision=bf16-master", "trainer.fp8.min_size=0", "trainer.enable_progress_bar=false",
                         "trainer.max_steps=4", "trainer.memory_check=false", "trainer.num_sanity_val_steps=0",
                         "trainer.limit_val_batches=0", std::string("model.activation_checkpointing=") + (i ? "blocks" : "none")},
                        "");
    ASSERT_EQ(run->trainer->fit(), 0);
    params[i] = strobe::testing::params_of(*run->module);
  }
  EXPECT_TRUE(strobe::testing::bitwise_equal(params[0], params[1]));
}

}  // namespace
