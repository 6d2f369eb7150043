// The resolved config of every shipped experiment round-trips: load -> resolve -> write -> load ->
// resolve -> write gives the same text, every key keeps its YAML type and value (a reader that knows
// nothing of Strobe sees the same document), and the experiment read back is the same.
#include <gtest/gtest.h>

#include <filesystem>

#include "strobe/config/experiment_parse.h"
#include "strobe/core/callback.h"
#include "tests/cli/cli_test_util.h"
#include "tests/config/yaml_types.h"
#include "tests/source_path.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

// Sizes only (never a key's type): the GPU experiments' models hold up to a billion weights.
std::vector<std::string> cheap_sizes(const std::string& yaml) {
  std::vector<std::string> sets = {"trainer.device=cpu"};
  if (yaml.find("name: face_detector") != std::string::npos) sets.push_back("model.hidden_dim=64");
  if (yaml.find("name: vit") != std::string::npos || yaml.find("name: decoder_lm") != std::string::npos)
    for (const char* s : {"model.embed_dim=64", "model.depth=1", "model.num_heads=2"}) sets.push_back(s);
  if (yaml.find("name: llama") != std::string::npos)  // (grouped K/V kept: 2 query heads per K/V head)
    for (const char* s : {"model.embed_dim=64", "model.depth=1", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_dim=128"})
      sets.push_back(s);
  if (yaml.find("num_classes: 1000") != std::string::npos)
    for (const char* s : {"model.num_classes=10", "data.num_classes=10"}) sets.push_back(s);
  return sets;
}

std::string resolve(const std::string& yaml, const std::string& name, const std::vector<std::string>& sets) {
  auto doc = config::Document::load_string(yaml, name);
  for (const auto& s : sets) doc.apply_override(s);
  RunOptions opt;
  opt.create_run_dir = false;
  return build_run(doc, opt)->resolved_yaml;
}

void expect_same_trainer(const config::TrainerConfig& a, const config::TrainerConfig& b, const std::string& what) {
  auto same_cf = [](const config::CountOrFraction& x, const config::CountOrFraction& y) {
    return x.is_count == y.is_count && (x.is_count ? x.count == y.count : x.fraction == y.fraction);
  };
  EXPECT_EQ(a.max_epochs, b.max_epochs) << what;
  EXPECT_EQ(a.max_steps, b.max_steps) << what;
  EXPECT_EQ(a.precision, b.precision) << what;
  EXPECT_TRUE(same_cf(a.val_check_interval, b.val_check_interval)) << what;
  EXPECT_TRUE(same_cf(a.limit_train_batches, b.limit_train_batches)) << what;
  EXPECT_TRUE(same_cf(a.limit_val_batches, b.limit_val_batches)) << what;
  EXPECT_TRUE(same_cf(a.limit_test_batches, b.limit_test_batches)) << what;
  EXPECT_TRUE(same_cf(a.overfit_batches, b.overfit_batches)) << what;
  EXPECT_EQ(a.gradient_clip_val, b.gradient_clip_val) << what;
  EXPECT_EQ(a.log_every_n_steps, b.log_every_n_steps) << what;
  EXPECT_EQ(a.num_sanity_val_steps, b.num_sanity_val_steps) << what;
}

}  // namespace

TEST(ResolvedConfig, EveryShippedConfigRoundTripsWithTypesAndValues) {
  const std::string src = strobe::testing::source_path("");
  int checked = 0, external = 0;
  for (const char* sub : {"configs", "configs/cpu"}) {
    for (const auto& e : std::filesystem::directory_iterator(src + "/" + sub)) {
      if (e.path().extension() != ".yaml") continue;
      const std::string path = e.path().string();
      SCOPED_TRACE(path);
      const std::string yaml = slurp(path);
      if (yaml.find("name: fashion_mnist") != std::string::npos &&
          !std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
        ADD_FAILURE() << "dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
        continue;
      }
      // The real-data examples (image_folder, coco_boxes, two token_file LMs, finetune_vit) point at
      // datasets under /data that no test machine has, and four tensor_file recipes at the files
      // their scripts write into datasets/; tests/data trains each of them on generated fixtures
      // (finetune_vit: tests/python/test_pretrained.py, with timm's weights; the tensor_file ones:
      // tests/cli/tensor_file_test.cpp and tests/python/test_doc_commands.py).
      if (yaml.find(": /data/") != std::string::npos || yaml.find(": datasets/") != std::string::npos) {
        ++external;
        continue;
      }
      auto sets = cheap_sizes(yaml);
      const std::string r1 = resolve(yaml, path, sets);
      const std::string r2 = resolve(r1, "config.yaml", {});
      EXPECT_EQ(r2, r1) << "resolving the resolved config changed it";
      const auto original = flat(yaml), first = flat(r1);
      EXPECT_EQ(flat(r2), first);
      // Every key the file sets keeps its type and value (except the sizes overridden above).
      auto overridden = [&](const std::string& key) {
        for (const auto& s : sets) {
          const std::string p = "." + s.substr(0, s.find('='));
          if (key == p || key.rfind(p + ".", 0) == 0 || key.rfind(p + "[", 0) == 0) return true;
        }
        return false;
      };
      for (const auto& [key, typed] : original) {
        if (overridden(key)) continue;
        ASSERT_TRUE(first.count(key)) << key << " is missing from the resolved config";
        EXPECT_EQ(first.at(key), typed) << key;
      }
      auto d1 = config::Document::load_string(yaml, path), d2 = config::Document::load_string(r1, "config.yaml");
      for (const auto& s : sets) d1.apply_override(s);
      expect_same_trainer(config::parse_experiment(d1).trainer, config::parse_experiment(d2).trainer, path);
      ++checked;
    }
  }
  EXPECT_GE(checked, 14);
  EXPECT_LE(external, 9) << "more real-data configs than the nine examples: give them fixtures here";
}
