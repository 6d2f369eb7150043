// strobe export (runner/export.h): a checkpoint's model weights as a safetensors file. Here: the file
// holds exactly the checkpoint's model tensors, bit for bit, with the metadata, and every bad input is
// one line with exit 2. tests/python/test_safetensors.py loads an export in the safetensors package and
// in torchvision's resnet18 (strict).
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/safetensors.h"
#include "tests/cli/cli_test_util.h"

namespace strobe {
namespace {

using testing::count_lines;
using testing::slurp;
using testing::strobe_cmd;
using testing::temp_dir;
using testing::tiny_yaml;
using testing::write_config;

const char* kResnet = " --set 'model={name: resnet, depth: 18, width: 4, num_classes: 4, in_channels: 1}'";

TEST(CliExport, WritesTheCheckpointsModelTensorsBitExactlyWithTheirMetadata) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("export");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=3" + kResnet);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = dir + "/checkpoints/last.ckpt";
  const std::string out = dir + "/weights.safetensors";
  r = strobe_cmd("export " + ckpt + " -o " + out);
  ASSERT_EQ(r.code, 0) << r.err;

  checkpoint::CheckpointData data = checkpoint::load_checkpoint_file(ckpt);
  safetensors::File file = safetensors::read_file(out);
  std::map<std::string, torch::Tensor> expected;
  for (const auto& [k, t] : data.tensors)
    if (k.rfind("model/", 0) == 0) expected[k.substr(6)] = t;
  ASSERT_GT(expected.size(), 60u);  // resnet18: 62 parameters and 60 BatchNorm buffers
  EXPECT_EQ(r.out, "strobe export: " + std::to_string(expected.size()) + " tensors of " + ckpt + " written to " + out + "\n");
  ASSERT_EQ(file.tensors.size(), expected.size());
  for (const auto& [name, t] : file.tensors) {
    ASSERT_TRUE(expected.count(name)) << name;
    const torch::Tensor& e = expected[name];
    EXPECT_EQ(t.scalar_type(), e.scalar_type()) << name;
    EXPECT_TRUE(t.sizes() == e.sizes() && torch::equal(t, e.contiguous())) << name;
  }
  EXPECT_TRUE(expected.count("conv1.weight") && expected.count("layer4.1.bn2.running_var") && expected.count("fc.bias"));
  EXPECT_EQ(file.metadata.at("format"), "pt");
  EXPECT_EQ(file.metadata.at("strobe.version"), STROBE_VERSION);
  EXPECT_EQ(file.metadata.at("strobe.step"), "3");
  EXPECT_EQ(file.metadata.at("strobe.epoch"), "0");
  const std::string model = file.metadata.at("strobe.model");
  for (const char* key : {"name: resnet", "depth: 18", "width: 4", "num_classes: 4", "in_channels: 1", "stem:"})
    EXPECT_NE(model.find(key), std::string::npos) << key << " not in\n" << model;  // resolved: defaults filled in
}

TEST(CliExport, BadInputIsOneLineAndExitTwoAndAnExistingFileIsKept) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("export_bad");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + " --set trainer.max_steps=1");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = dir + "/checkpoints/last.ckpt";
  // Usage errors end their one line with "; run 'strobe --help' for usage", as for every command.
  auto refused = [&](const std::string& args, const std::string& first_line) {
    auto res = strobe_cmd(args);
    EXPECT_EQ(res.code, 2) << args << "\n" << res.err;
    EXPECT_EQ(res.err.rfind(first_line, 0), 0u) << args << "\n" << res.err;
    EXPECT_EQ(count_lines(res.err), 1) << res.err;
    EXPECT_EQ(res.out, "") << res.out;
  };
  const std::string out = dir + "/w.safetensors";
  refused("export " + cfg + " -o " + out, "strobe: checkpoint error: " + cfg + ": ");
  refused("export " + ckpt, "strobe: --output is required; run 'strobe --help' for usage");
  std::ofstream(dir + "/keep.safetensors") << "mine";
  refused("export " + ckpt + " -o " + dir + "/keep.safetensors",
          "strobe export: -o " + dir + "/keep.safetensors: exists (pass --overwrite to replace it)");
  EXPECT_EQ(slurp(dir + "/keep.safetensors"), "mine");
  refused("export " + ckpt + " -o " + dir, "strobe export: -o " + dir + ": is a directory");
  refused("export " + ckpt + " -o " + cfg + "/sub/w.safetensors",
          "strobe export: -o " + cfg + "/sub/w.safetensors: cannot reach the directory " + cfg + "/sub (Not a directory)");
  EXPECT_FALSE(std::filesystem::exists(out));
  // A checkpoint whose saved config is damaged: named with its line, before anything is written.
  checkpoint::CheckpointData damaged = checkpoint::load_checkpoint_file(ckpt);
  damaged.blobs["config"] = "model:\n  name: [mlp\n";
  checkpoint::save_checkpoint_file(dir + "/damaged.ckpt", damaged);
  for (const char* names : {"strobe", "timm"})
    refused("export " + dir + "/damaged.ckpt -o " + out + " --names " + names,
            "strobe: checkpoint error: " + dir + "/damaged.ckpt (saved config):3:1: invalid YAML");
  EXPECT_FALSE(std::filesystem::exists(out));
  r = strobe_cmd("export " + ckpt + " -o " + dir + "/keep.safetensors --overwrite");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_GT(safetensors::read_file(dir + "/keep.safetensors").tensors.size(), 0u);
}

TEST(CliExport, NamesWritesAnotherLibrarysNamesAndRefusesWhatItCannotBuild) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("export_names");
  const std::string vit =
      " --set 'model={name: vit, img_size: 8, patch_size: 4, in_channels: 1, num_classes: 4, embed_dim: 16, depth: 2, "
      "num_heads: 2}'";
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/vit --set trainer.max_steps=1" + vit);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = dir + "/vit/checkpoints/last.ckpt";
  const std::string out = dir + "/vit.timm.safetensors";
  r = strobe_cmd("export " + ckpt + " -o " + out + " --names timm");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "strobe export: 32 tensors of " + ckpt + " written to " + out + " (timm names)\n");
  safetensors::File file = safetensors::read_file(out);
  std::map<std::string, torch::Tensor> got(file.tensors.begin(), file.tensors.end());
  checkpoint::CheckpointData data = checkpoint::load_checkpoint_file(ckpt);
  // Renamed, bit for bit.
  EXPECT_TRUE(torch::equal(got.at("blocks.1.attn.qkv.weight"), data.tensor("model/blocks.1.qkv.weight")));
  EXPECT_TRUE(torch::equal(got.at("patch_embed.proj.weight"), data.tensor("model/patch_embed.weight")));
  EXPECT_TRUE(torch::equal(got.at("blocks.0.mlp.fc2.bias"), data.tensor("model/blocks.0.fc2.bias")));
  EXPECT_EQ(got.count("blocks.0.qkv.weight"), 0u);
  EXPECT_EQ(file.metadata.at("strobe.names"), "timm");

  auto refused = [&](const std::string& args, const std::string& line) {
    auto res = strobe_cmd(args);
    EXPECT_EQ(res.code, 2) << args << "\n" << res.err;
    EXPECT_EQ(res.err, line) << args;
    EXPECT_EQ(res.out, "");
  };
  refused("export " + ckpt + " -o " + dir + "/x.safetensors --names hf",
          "strobe export: --names hf: model 'vit' has no name set 'hf' (it has: strobe, timm, torchvision)\n");
  r = strobe_cmd("export " + ckpt + " -o " + dir + "/vit.tv.safetensors --names torchvision");
  ASSERT_EQ(r.code, 0) << r.err;
  safetensors::File tv = safetensors::read_file(dir + "/vit.tv.safetensors");
  std::map<std::string, torch::Tensor> tv_got(tv.tensors.begin(), tv.tensors.end());
  EXPECT_TRUE(torch::equal(tv_got.at("encoder.layers.encoder_layer_1.self_attention.in_proj_weight"),
                           data.tensor("model/blocks.1.qkv.weight")));
  EXPECT_TRUE(torch::equal(tv_got.at("class_token"), data.tensor("model/cls_token")));

  r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/mlp --set trainer.max_steps=1");
  ASSERT_EQ(r.code, 0) << r.err;
  refused("export " + dir + "/mlp/checkpoints/last.ckpt -o " + dir + "/x.safetensors --names timm",
          "strobe export: --names timm: model 'mlp' has no name set 'timm' (it has: strobe)\n");
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/resnet --set trainer.max_steps=1 --set "
                 "'model={name: resnet, depth: 18, width: 4, num_classes: 4, in_channels: 1, stem: cifar}'");
  ASSERT_EQ(r.code, 0) << r.err;
  refused("export " + dir + "/resnet/checkpoints/last.ckpt -o " + dir + "/x.safetensors --names torchvision",
          "strobe export: --names torchvision: torchvision's ResNet has no stem 'cifar' (its stem is the 7x7 stride-2 "
          "conv and max-pool: stem: imagenet)\n");
  EXPECT_FALSE(std::filesystem::exists(dir + "/x.safetensors"));
}

}  // namespace
}  // namespace strobe

namespace strobe {
namespace {

// --names hf of a llama: a Hugging Face checkpoint directory whose tensors are the checkpoint's
// under HF's names (tests/python/test_hf_llama.py loads one in transformers); it never writes into
// a directory that holds files unless --overwrite, nor over a file.
TEST(CliExport, NamesHfWritesACheckpointDirectoryAndRefusesToWriteOverFiles) {
  const std::string dir = testing::temp_dir("export-hf");
  auto r = testing::strobe_cmd("fit -c " + testing::source_path("configs/cpu/llama_1b.yaml") + " --run-dir " + dir +
                               "/run --set trainer.max_steps=2 --set trainer.enable_progress_bar=false");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = dir + "/run/checkpoints/last.ckpt", out = dir + "/hf";
  r = testing::strobe_cmd("export " + ckpt + " --names hf -o " + out);
  ASSERT_EQ(r.code, 0) << r.err;
  auto file = safetensors::read_file(out + "/model.safetensors");
  auto data = checkpoint::load_checkpoint_file(ckpt);
  size_t model_tensors = 0;
  for (const auto& [k, t] : data.tensors) {
    if (k.rfind("model/", 0) != 0) continue;
    ++model_tensors;
    const std::string hf = "model." + k.substr(6);
    bool found = false;
    for (const auto& [name, ft] : file.tensors) found |= name == hf && torch::equal(ft, t);
    EXPECT_TRUE(found) << hf;
  }
  EXPECT_EQ(file.tensors.size(), model_tensors) << "tied: no lm_head.weight beside model.embed_tokens.weight";
  const std::string config = testing::slurp(out + "/config.json");
  for (const char* key : {"\"LlamaForCausalLM\"", "\"num_key_value_heads\": 2", "\"tie_word_embeddings\": true",
                          "\"rope_type\": \"llama3\"", "\"rope_theta\": 500000.0"})
    EXPECT_NE(config.find(key), std::string::npos) << key << " not in\n" << config;

  // That directory as model.init_from with a config.json of the wrong shape: exit 2 before any step,
  // one line naming the file and the key (never the JSON library's exception text).
  const nlohmann::json good = nlohmann::json::parse(config);
  auto with = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json j = good;
    j[key] = value;
    return j.dump();
  };
  int n = 0;
  for (const auto& [json, says] : std::vector<std::pair<std::string, std::string>>{
           {"[1, 2]", "it is an array, not a JSON object"},
           {with("tie_word_embeddings", "true"), "tie_word_embeddings: \"true\" in config.json is a string, expected true or false"},
           {with("hidden_act", nlohmann::json::array({"silu"})), "hidden_act: [\"silu\"] in config.json is an array, expected a string"},
           {with("rope_scaling", "llama3"), "rope_scaling: \"llama3\" in config.json is a string, expected an object"},
           {with("model_type", 7), "model_type: 7 in config.json is a number, expected a string"}}) {
    std::ofstream(out + "/config.json", std::ios::trunc) << json;
    r = testing::strobe_cmd("fit -c " + testing::source_path("configs/cpu/llama_1b.yaml") + " --run-dir " + dir + "/bad" +
                            std::to_string(n++) + " --set 'model.init_from={path: " + out + ", names: hf}' --set trainer.max_steps=1");
    EXPECT_EQ(r.code, 2) << json << "\n" << r.err;
    EXPECT_NE(r.err.find(out + "/config.json does not describe this model: " + says), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  // One that cannot be read says why (a directory here; a file without read permission says so too).
  std::filesystem::remove(out + "/config.json");
  std::filesystem::create_directories(out + "/config.json");
  r = testing::strobe_cmd("fit -c " + testing::source_path("configs/cpu/llama_1b.yaml") + " --run-dir " + dir +
                          "/bad_dir --set 'model.init_from={path: " + out + ", names: hf}' --set trainer.max_steps=1");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find(out + "/config.json: is a directory, not a regular file"), std::string::npos) << r.err;
  std::filesystem::remove(out + "/config.json");
  // Nested 100,000 deep: refused for its depth in one line, not by running out of memory.
  std::ofstream(out + "/config.json", std::ios::trunc) << std::string(100000, '[');
  r = testing::strobe_cmd("fit -c " + testing::source_path("configs/cpu/llama_1b.yaml") + " --run-dir " + dir +
                          "/deep --set 'model.init_from={path: " + out + ", names: hf}' --set trainer.max_steps=1");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find(out + "/config.json: not valid JSON: nests deeper than 64 levels"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  std::ofstream(out + "/config.json", std::ios::trunc) << config;

  // The directory alone, with no shape key: the shape comes from its config.json (as from_pretrained
  // takes it), the weights load strictly, and the run's config.yaml records the keys taken.
  r = testing::strobe_cmd("fit -c " + testing::source_path("configs/cpu/llama_1b.yaml") + " --run-dir " + dir +
                          "/from_config --set 'model={name: llama, attention: math, init_from: {path: " + out +
                          ", names: hf}}' --set trainer.max_steps=1 --set trainer.enable_progress_bar=false");
  ASSERT_EQ(r.code, 0) << r.err;
  const YAML::Node taken = YAML::LoadFile(dir + "/from_config/config.yaml")["model"];
  EXPECT_EQ(taken["vocab_size"].as<int64_t>(), 512);
  EXPECT_EQ(taken["embed_dim"].as<int64_t>(), 64);
  EXPECT_EQ(taken["depth"].as<int64_t>(), 2);
  EXPECT_EQ(taken["num_heads"].as<int64_t>(), 4);
  EXPECT_EQ(taken["num_kv_heads"].as<int64_t>(), 2);
  EXPECT_EQ(taken["ffn_dim"].as<int64_t>(), 256);
  EXPECT_EQ(taken["max_seq_len"].as<int64_t>(), 64);
  EXPECT_EQ(taken["rope_theta"].as<double>(), 500000.0);
  EXPECT_EQ(taken["rope_scaling"]["factor"].as<double>(), 32.0);
  EXPECT_EQ(taken["rope_scaling"]["original_max_position_embeddings"].as<int64_t>(), 16);
  EXPECT_TRUE(taken["tie_embeddings"].as<bool>());
  // That run's checkpoint with the same config (the shape keys still left out): the shape comes from
  // the config.json the checkpoint recorded, for test and for a resume, with the directory gone.
  const std::string shapeless = "-c " + testing::source_path("configs/cpu/llama_1b.yaml") +
                                " --set 'model={name: llama, attention: math, init_from: {path: " + out + ", names: hf}}'";
  const std::string from_ckpt = dir + "/from_config/checkpoints/last.ckpt";
  std::filesystem::rename(out, out + ".moved");
  r = testing::strobe_cmd("test " + shapeless + " --ckpt " + from_ckpt + " --set trainer.limit_test_batches=1");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("test/loss"), std::string::npos) << r.out;
  r = testing::strobe_cmd("fit " + shapeless + " --ckpt " + from_ckpt + " --run-dir " + dir +
                          "/from_config --set trainer.max_steps=2 --set trainer.enable_progress_bar=false");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("strobe fit: resuming from " + from_ckpt + " (step 1) with changes: trainer.max_steps: 1 -> 2"),
            std::string::npos)
      << r.out;
  std::filesystem::rename(out + ".moved", out);
  // Numbers compare as numbers: the run's own config.yaml with rope_theta written as an integer.
  r = testing::strobe_cmd("fit -c " + dir + "/from_config/config.yaml --ckpt " + from_ckpt +
                          " --set model.rope_theta=500000 --set trainer.max_steps=3 --set trainer.enable_progress_bar=false");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("rope_theta"), std::string::npos) << r.out;
  // A config of another shape is refused, pointing at the run's own config.yaml.
  r = testing::strobe_cmd("test -c " + testing::source_path("configs/cpu/llama_1b.yaml") + " --ckpt " + from_ckpt +
                          " --set model.depth=3");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("; -c " + dir + "/from_config/config.yaml builds the model this checkpoint was trained as\n"),
            std::string::npos)
      << r.err;
  // A key that is set is the config's and is checked against the file as before.
  r = testing::strobe_cmd("fit -c " + testing::source_path("configs/cpu/llama_1b.yaml") + " --run-dir " + dir +
                          "/set_depth --set 'model={name: llama, depth: 3, init_from: {path: " + out +
                          ", names: hf}}' --set trainer.max_steps=1");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("num_hidden_layers: 2 in config.json, model.depth: 3"), std::string::npos) << r.err;

  r = testing::strobe_cmd("export " + ckpt + " --names hf -o " + out);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe export: -o " + out + ": the directory holds files (pass --overwrite to replace the ones this "
                    "command writes)\n");
  r = testing::strobe_cmd("export " + ckpt + " --names hf -o " + out + " --overwrite");
  EXPECT_EQ(r.code, 0) << r.err;
  r = testing::strobe_cmd("export " + ckpt + " --names hf -o " + out + "/config.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("exists and is not a directory"), std::string::npos) << r.err;
  r = testing::strobe_cmd("export " + ckpt + " --names hf -o " + dir + "/llama.safetensors");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe export: -o " + dir + "/llama.safetensors: --names hf writes a directory (config.json + "
                    "model.safetensors), not a .safetensors file: give a directory name\n");
  EXPECT_FALSE(std::filesystem::exists(dir + "/llama.safetensors"));

  // A target that cannot be replaced (config.json is a directory): refused before either file is
  // renamed: model.safetensors stays as it was, the directory's other files stay, no temporary is left.
  const std::string weights = testing::slurp(out + "/model.safetensors");
  std::filesystem::remove(out + "/config.json");
  std::filesystem::create_directories(out + "/config.json");
  std::ofstream(out + "/tokenizer.json") << "{}";
  r = testing::strobe_cmd("fit -c " + testing::source_path("configs/cpu/llama_1b.yaml") + " --ckpt " + ckpt +
                          " --set trainer.max_steps=3 --set trainer.enable_progress_bar=false");
  ASSERT_EQ(r.code, 0) << r.err;  // other weights to export
  r = testing::strobe_cmd("export " + ckpt + " --names hf -o " + out + " --overwrite");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe export: -o " + out + ": " + out + "/config.json is a directory; nothing was replaced\n");
  EXPECT_EQ(testing::slurp(out + "/model.safetensors"), weights) << "model.safetensors was replaced";
  EXPECT_TRUE(std::filesystem::exists(out + "/tokenizer.json"));
  for (const auto& e : std::filesystem::directory_iterator(out))
    EXPECT_NE(e.path().filename().string()[0], '.') << e.path() << " left behind";

  // The output is never the input, --overwrite or not.
  const std::string ckpt_bytes = testing::slurp(ckpt);
  r = testing::strobe_cmd("export " + ckpt + " -o " + ckpt + " --overwrite");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe export: -o " + ckpt + ": is the checkpoint being exported, an input of this command; it is "
                    "never replaced, --overwrite or not: write elsewhere\n");
  EXPECT_EQ(testing::slurp(ckpt), ckpt_bytes);
}

}  // namespace
}  // namespace strobe
