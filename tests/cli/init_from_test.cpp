// model.init_from (docs/MODELS.md "Pretrained weights"): a safetensors file's tensors are loaded into
// the freshly built model, before the optimizer and the device move see it; what does not fit is one
// error listing every name (exit 2) unless `ignore` covers it or `strict: false`; a resume loads the
// checkpoint's weights instead and says so once; validate/test evaluate the file's weights without
// --ckpt. tests/python/test_pretrained.py checks timm and torchvision names against those libraries.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "strobe/checkpoint/safetensors.h"
#include "strobe/core/weight_names.h"
#include "tests/cli/cli_test_util.h"
#include "tests/cli/init_from_check.h"
#include "tests/source_path.h"

namespace strobe {
namespace {

using testing::count_lines;
using testing::make_run;
using testing::strobe_cmd;
using testing::temp_dir;
using testing::tiny_yaml;
using testing::write_config;

// The tiny mlp's tensors (fc0, fc1, head), drawn with another seed than the model's own init.
std::map<std::string, torch::Tensor> mlp_file_tensors(int64_t num_classes = 4) {
  torch::manual_seed(1234);
  return {{"fc0.weight", torch::randn({32, 64})}, {"fc0.bias", torch::randn({32})},
          {"fc1.weight", torch::randn({16, 32})}, {"fc1.bias", torch::randn({16})},
          {"head.weight", torch::randn({num_classes, 16})}, {"head.bias", torch::randn({num_classes})}};
}

std::string write_weights(const std::string& dir, const std::map<std::string, torch::Tensor>& tensors,
                          const std::string& name = "w.safetensors") {
  safetensors::NamedTensors named(tensors.begin(), tensors.end());
  const std::string path = dir + "/" + name;
  safetensors::write_file(path, named);
  return path;
}

std::map<std::string, torch::Tensor> params_of(Run& run) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : run.module->net().named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

TEST(InitFrom, LoadsTheFilesTensorsIntoTheModelBeforeTraining) {
  const std::string dir = temp_dir("init_from");
  const auto file = mlp_file_tensors();
  const std::string path = write_weights(dir, file);
  // The scalar form: names strobe, strict; the resolved config spells every key out.
  auto run = make_run(tiny_yaml(), {"model.init_from=" + path}, "");
  const auto got = params_of(*run);
  ASSERT_EQ(got.size(), file.size());
  for (const auto& [name, t] : file) EXPECT_TRUE(torch::equal(got.at(name), t)) << name;
  for (const char* key : {"init_from:", "path: " , "names: strobe", "strict: true", "ignore: []"})
    EXPECT_NE(run->resolved_yaml.find(key), std::string::npos) << key << "\n" << run->resolved_yaml;

  // Without init_from the same seed gives other weights: the test above did not pass by accident.
  auto fresh = make_run(tiny_yaml(), {}, "");
  EXPECT_FALSE(torch::equal(params_of(*fresh).at("fc0.weight"), file.at("fc0.weight")));

  // Other dtypes are converted to the model's (a bf16 file into an fp32 model).
  std::map<std::string, torch::Tensor> half;
  for (const auto& [name, t] : file) half[name] = t.to(torch::kBFloat16);
  const std::string half_path = write_weights(dir, half, "bf16.safetensors");
  auto run16 = make_run(tiny_yaml(), {"model.init_from=" + half_path}, "");
  for (const auto& [name, t] : params_of(*run16)) {
    EXPECT_EQ(t.scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(t, half.at(name).to(torch::kFloat32))) << name;
  }
}

TEST(InitFrom, EveryNameThatDoesNotFitIsListedInOneErrorWithExitTwo) {
  const std::string dir = temp_dir("init_from_bad");
  auto file = mlp_file_tensors(/*num_classes=*/10);  // a 10-class head into a 6-class model
  file.erase("fc1.bias");
  file["extra.weight"] = torch::zeros({3});
  const std::string path = write_weights(dir, file);
  const std::string cfg = write_config(tiny_yaml());
  const std::string run_dir = dir + "/run";
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + run_dir + " --set model.num_classes=6 --set model.init_from=" + path);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_EQ(r.err.rfind("strobe: config error: --set model.init_from=" + path + ": model.init_from: ", 0), 0u) << r.err;
  for (const std::string& want : std::vector<std::string>{
           path + " (strobe names) does not fit model 'mlp': ", "1 missing from the file: fc1.bias",
        "1 not in the model: extra.weight",
        "2 of another shape: head.weight: [10, 16] in the file, [6, 16] in the model, head.bias: [10] in the file, [6] "
        "in the model",
        "model.init_from.ignore (here: [\"head.*\", \"fc1.bias\", \"extra.weight\"])", "model.init_from.strict: false"})
    EXPECT_NE(r.err.find(want), std::string::npos) << want << "\n" << r.err;
  EXPECT_FALSE(std::filesystem::exists(run_dir)) << "refused before the run directory is claimed";
  // The hint names the modules of this file's misfits (a ResNet's head is fc.*, not head.*).
  auto other = mlp_file_tensors(/*num_classes=*/6);
  other["fc0.weight"] = torch::zeros({other.at("fc0.weight").size(0) + 1, other.at("fc0.weight").size(1)});
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + run_dir + " --set model.num_classes=6 --set model.init_from=" +
                 write_weights(dir, other, "fc0.safetensors"));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("model.init_from.ignore (here: [\"fc0.*\"])"), std::string::npos) << r.err;
  // Hugging Face's spelling ("model." before every name) under names: strobe says so.
  std::map<std::string, torch::Tensor> hf_spelled;
  for (const auto& [name, t] : mlp_file_tensors(/*num_classes=*/6)) hf_spelled["model." + name] = t;
  r = strobe_cmd("fit -c " + cfg + " --run-dir " + run_dir + " --set model.num_classes=6 --set model.init_from=" +
                 write_weights(dir, hf_spelled, "hf_spelled.safetensors"));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("the file's names start with 'model.', as a Hugging Face checkpoint's do: model 'mlp' has no "
                       "Hugging Face name set (names: hf)"),
            std::string::npos)
      << r.err;

  // `ignore` globs cover names on both sides, as the file spells them; the rest loads.
  auto run = make_run(tiny_yaml(), {"model.num_classes=6",
                                    "model.init_from={path: " + path + ", ignore: ['head.*', extra.weight, fc1.bias]}"},
                      "");
  auto got = params_of(*run);
  EXPECT_TRUE(torch::equal(got.at("fc0.weight"), file.at("fc0.weight")));
  EXPECT_TRUE(torch::equal(got.at("fc1.weight"), file.at("fc1.weight")));
  auto fresh = make_run(tiny_yaml(), {"model.num_classes=6"}, "");
  auto init = params_of(*fresh);
  for (const char* kept : {"fc1.bias", "head.weight", "head.bias"})
    EXPECT_TRUE(torch::equal(got.at(kept), init.at(kept))) << kept << " keeps the model's own initialisation";

  // strict: false loads what fits and warns, listing the rest.
  r = strobe_cmd("validate -c " + cfg + " --set model.num_classes=6 --set 'model.init_from={path: " + path +
                 ", strict: false}'");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("strobe: warning: model.init_from: " + path + " (strobe names) does not fit model 'mlp' "
                       "(strict: false): 1 missing from the file: fc1.bias; 1 not in the model: extra.weight; 2 of "
                       "another shape: head.weight"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("strobe: model.init_from: 3 tensors loaded from " + path + " (strobe names)\n"), std::string::npos) << r.out;
}

TEST(InitFrom, BadSettingsAndBadFilesAreOneLineAndExitTwo) {
  const std::string dir = temp_dir("init_from_keys");
  const std::string path = write_weights(dir, mlp_file_tensors());
  const std::string cfg = write_config(tiny_yaml());
  std::ofstream(dir + "/junk.safetensors") << "not a safetensors file at all";
  struct Case {
    std::string set, expect;
  } cases[] = {
      {"'model.init_from={path: " + path + ", names: timm}'",
       "model.init_from.names: model 'mlp' has no name set 'timm' (it has: strobe)"},
      {"'model.init_from={path: " + path + ", names: strobes}'", "did you mean 'strobe'?"},
      {"'model.init_from={names: strobe}'", "model.init_from: missing required key 'path'"},
      {"'model.init_from={path: " + path + ", strict: maybe}'", "model.init_from.strict"},
      {"'model.init_from={path: " + path + ", ignored: [x]}'", "model.init_from.ignored: unknown key; did you mean 'ignore'?"},
      {"'model.init_from={path: " + path + ", ignore: head}'", "model.init_from.ignore"},
      {"'model.init_from=[" + path + "]'", "model.init_from"},
      {"model.init_from=" + dir + "/absent.safetensors",
       "model.init_from.path: " + dir + "/absent.safetensors: cannot open (No such file or directory)"},
      {"model.init_from=" + dir + "/junk.safetensors",
       "model.init_from.path: " + dir + "/junk.safetensors: not a safetensors file: "},
  };
  for (const auto& c : cases) {
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run --set " + c.set);
    EXPECT_EQ(r.code, 2) << c.set << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.set << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_FALSE(std::filesystem::exists(dir + "/run")) << c.set;
  }
}

TEST(InitFrom, ValidateAndTestEvaluateTheFilesWeightsWithoutACheckpoint) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("init_from_eval");
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run --set trainer.max_steps=5");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string ckpt = dir + "/run/checkpoints/last.ckpt";
  r = strobe_cmd("export " + ckpt + " -o " + dir + "/w.safetensors");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const std::string cmd : {"validate", "test"}) {
    auto by_ckpt = strobe_cmd(cmd + " -c " + cfg + " --ckpt " + ckpt);
    auto by_file = strobe_cmd(cmd + " -c " + cfg + " --set model.init_from=" + dir + "/w.safetensors");
    ASSERT_EQ(by_ckpt.code, 0) << by_ckpt.err;
    ASSERT_EQ(by_file.code, 0) << by_file.err;
    // The metric lines (after the header line) are the same numbers.
    const std::string tail_ckpt = by_ckpt.out.substr(by_ckpt.out.find('\n', by_ckpt.out.find("strobe " + cmd + ": ")));
    const std::string tail_file = by_file.out.substr(by_file.out.find('\n', by_file.out.find("strobe " + cmd + ": ")));
    EXPECT_EQ(tail_file, tail_ckpt) << by_file.out << "\n" << by_ckpt.out;
    EXPECT_NE(tail_file.find(cmd == "validate" ? "val/loss" : "test/loss"), std::string::npos) << tail_file;
    EXPECT_NE(by_file.out.find("strobe " + cmd + ": weights of model.init_from " + dir + "/w.safetensors\n"),
              std::string::npos)
        << by_file.out;
  }
  r = strobe_cmd("validate -c " + cfg);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "strobe: config error: strobe validate: --ckpt is required (the checkpoint to evaluate), unless "
                   "model.init_from names the weights\n");
}

TEST(InitFrom, AResumeLoadsTheCheckpointAndSaysOnceThatInitFromIsIgnored) {
  const std::string cfg = write_config(tiny_yaml());
  const std::string dir = temp_dir("init_from_resume");
  const std::string path = write_weights(dir, mlp_file_tensors());
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run --set trainer.max_steps=3 --set model.init_from=" + path);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("strobe: model.init_from: 6 tensors loaded from " + path + " (strobe names)\n"), std::string::npos)
      << r.out;
  // The file is gone and init_from changed: neither matters to a resume, which says so once.
  std::filesystem::remove(path);
  const std::string ckpt = dir + "/run/checkpoints/last.ckpt";
  r = strobe_cmd("fit -c " + cfg + " --ckpt " + ckpt + " --set trainer.max_steps=5 --set 'model.init_from={path: " + path +
                 ", ignore: [\"head.*\"]}'");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string said = "strobe: model.init_from (" + path + ") is ignored: the weights come from --ckpt " + ckpt + "\n";
  ASSERT_NE(r.err.find(said), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(said, r.err.find(said) + 1), std::string::npos) << "said twice:\n" << r.err;
  EXPECT_NE(r.out.find("with changes: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model.init_from.ignore"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("tensors loaded"), std::string::npos) << r.out;
}

TEST(InitFrom, LoadsBeforeBf16MasterAndChannelsLastSeeTheWeights) {
  const std::string resnet = "{name: resnet, depth: 18, width: 8, num_classes: 4, in_channels: 1, stem: cifar}";
  testing::expect_init_from_survives("cpu", "32", resnet);
  testing::expect_init_from_survives(
      "cpu", "bf16-master", "{name: resnet, depth: 18, width: 8, num_classes: 4, in_channels: 1, stem: cifar, "
                            "memory_format: channels_last}");
}

TEST(InitFrom, ReplayOfACaptureTakesTheCapturesWeightsNotTheFile) {
  const std::string dir = temp_dir("init_from_replay");
  // A file whose every name is ignored: the run starts as without it, and its NaN capture follows.
  const std::string path = write_weights(dir, {{"unused", torch::zeros({2})}});
  auto r = strobe_cmd("fit -c " + testing::source_path("configs/cpu/resnet50_nan.yaml") + " --run-dir " + dir +
                      "/run --set trainer.enable_progress_bar=false --set 'model.init_from={path: " + path +
                      ", ignore: [\"*\"]}'");
  ASSERT_EQ(r.code, 3) << r.err;
  // 320 tensors of the model and the file's one, the first ten named.
  EXPECT_NE(r.out.find("strobe: model.init_from: 0 tensors loaded from " + path +
                       " (strobe names); ignored 321: conv1.weight, bn1.weight, bn1.bias, layer1.0.conv1.weight, "),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("layer1.0.conv3.weight and 311 more\n"), std::string::npos) << r.out;
  std::filesystem::remove(path);
  r = strobe_cmd("replay " + dir + "/run/nan");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("reproduction: EXACT"), std::string::npos) << r.out;
}

TEST(InitFrom, NameSetsOfAModelWithoutMapsAreStrobeAlone) {
  EXPECT_EQ(name_sets("mlp"), std::vector<std::string>{"strobe"});
}

}  // namespace
}  // namespace strobe
