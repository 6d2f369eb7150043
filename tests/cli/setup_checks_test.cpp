// Inputs that used to fail at the first step (exit 1, after the run directory was written) are
// refused at setup: one line naming the key, exit 2, no run directory. Integer features are read as
// float32, as documented, and train.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "data/image_codec.h"
#include "strobe/checkpoint/safetensors.h"
#include "tests/cli/cli_test_util.h"

namespace strobe::testing {
namespace {

namespace fs = std::filesystem;

std::string tensors_file(const fs::path& dir, const std::string& name, const safetensors::NamedTensors& t) {
  const std::string p = (dir / name).string();
  safetensors::write_file(p, t);
  return p;
}

TEST(CliSetupChecks, InputsThatWouldFailAtTheFirstStepAreRefusedBeforeAnyRunFile) {
  const fs::path d = temp_dir("setup_checks");
  torch::manual_seed(0);
  const auto x = torch::randn({64, 8});
  const auto y = torch::randint(0, 3, {64});
  const std::string good = tensors_file(d, "good.safetensors", {{"x", x}, {"y", y}});
  const std::string vec = tensors_file(d, "vec.safetensors", {{"x", torch::randn({64})}, {"y", y}});
  const std::string narrow = tensors_file(d, "narrow.safetensors", {{"x", torch::randn({16, 6})}, {"y", y.narrow(0, 0, 16)}});
  const std::string boolean = tensors_file(d, "bool.safetensors", {{"x", x}, {"y", y > 0}});
  // image_folder: four class folders under a head of three.
  for (const char* cls : {"a", "b", "c", "d"}) {
    fs::create_directories(d / "images" / cls);
    std::vector<uint8_t> px(8 * 8 * 3, 100);
    std::ofstream(d / "images" / cls / "0.png", std::ios::binary) << data::encode_png(px.data(), 8, 8, 3);
  }
  // A Hugging Face directory whose config.json's hidden_size no machine holds.
  fs::create_directories(d / "hf");
  std::ofstream(d / "hf" / "config.json") << R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 1048576,
      "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 32})";

  const std::string cls = write_config(R"(name: setup
trainer: {max_steps: 2, device: cpu, enable_progress_bar: false, num_sanity_val_steps: 0}
model: {name: mlp, in_features: 8, hidden: [8], num_classes: 3}
data: {name: tensor_file, path: )" + good + R"(, fields: {image: x, label: y}, batch_size: 8, num_workers: 0}
optimizer: {name: adamw, lr: 0.01}
)");
  const std::string llama = source_path("configs/cpu/llama_1b.yaml");
  const std::string run = (d / "run").string();
  const std::pair<std::string, std::string> cases[] = {
      {"-c " + cls + " --set 'optimizer.param_groups={freeze: [\"*\"]}'",
       "optimizer.param_groups: freeze selects every trainable parameter (4 tensors): the run would train nothing"},
      {"-c " + cls + " --set 'optimizer.param_groups={freeze: [\"fc*\", \"head.*\"], unfreeze_at_epoch: 1}'",
       "freeze selects every trainable parameter (4 tensors): epochs 0 to 0 would train nothing"},
      {"-c " + cls + " --set data.path=" + vec, "fields.image: tensor 'x' is a vector (64 values): one value per sample is not a row"},
      {"-c " + cls + " --set data.val_path=" + narrow,
       "data.val_path: " + narrow + ": fields.image: rows of shape [6] (tensor 'x'), but " + good + "'s rows are [8]"},
      {"-c " + cls + " --set data.path=" + boolean, "fields.label: tensor 'y' is BOOL, which tensor_file does not read"},
      {"-c " + cls + " --set 'model={name: vit, img_size: 8, patch_size: 4, in_channels: 1, num_classes: 3, embed_dim: 16, depth: 1, "
                     "num_heads: 2}'",
       "model 'vit' reads images, but data 'tensor_file' gives flat vectors of 8 values per sample"},
      {"-c " + cls + " --set 'data={name: image_folder, root: " + (d / "images").string() +
           ", image_size: 8, resize_size: 8, batch_size: 2, num_workers: 0}' --set model.in_features=192",
       "model.num_classes: 3 classes, but data.root " + (d / "images").string() + " has 4 class folders"},
      {"-c " + llama + " --set model.embed_dim=1048576",
       "model.embed_dim: the model's shape (embed_dim 1048576, depth 2, ffn_dim 256, vocab_size 512) holds about"},
      {"-c " + llama + " --set 'model.init_from={path: " + (d / "hf").string() + ", names: hf}' --set model.embed_dim=null",
       "of memory is available; use a smaller shape (model.embed_dim"},
      {"-c " + llama + " --set trainer.fp8=true",
       "trainer.fp8: needs trainer.precision bf16-master or bf16-mixed (the float8 GEMMs' outputs are bf16), got 32"},
      {"-c " + llama + " --set trainer.precision=bf16-master --set 'trainer.fp8={skip: [\"*.q\"], min_size: 0}'",
       "trainer.fp8.skip: '*.q' matches none of the 14 float8-capable linear layers of model 'llama'"},
      // trainer.strategy fsdp: a model without units, and a checkpoint one process would write alone.
      {"-c " + cls + " --set trainer.strategy=fsdp",
       "trainer.strategy: fsdp: model 'mlp' declares no units to shard (fsdp shards the blocks of llama, decoder_lm and vit)"},
      {"-c " + llama + " --set trainer.strategy=fsdp --set 'callbacks=[{name: ema}, {name: on_exception_checkpoint}]'",
       "on_exception_checkpoint is not available under trainer.strategy: fsdp (the process that fails would write the "
       "checkpoint alone"},
      {"-c " + llama + " --set trainer.strategy=zero2 --set trainer.reshard_after_forward=false",
       "trainer.reshard_after_forward: applies to trainer.strategy: fsdp, not zero2"},
  };
  for (const auto& [args, expect] : cases) {
    auto r = strobe_cmd("fit " + args + " --run-dir " + run);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(expect), std::string::npos) << args << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_FALSE(fs::exists(run)) << args << " left a run directory";
  }

  // Integer features (uint8 pixels, int32 counts) are read as float32 and train.
  for (const auto& [name, t] : {std::pair{"u8", (x.abs() * 40).to(torch::kUInt8)}, std::pair{"i32", (x * 10).to(torch::kInt32)}}) {
    const std::string f = tensors_file(d, std::string(name) + ".safetensors", {{"x", t}, {"y", y}});
    auto r = strobe_cmd("fit -c " + cls + " --set data.path=" + f + " --run-dir " + (d / name).string());
    EXPECT_EQ(r.code, 0) << name << "\n" << r.err;
  }
}

}  // namespace
}  // namespace strobe::testing
