// Plugins (runner/plugins.h): a component library built like a user's (tests/cli/plugins) trains
// through `strobe fit --plugin` and through `plugins:` in the experiment (relative to the config
// file), joins `strobe list` and the did-you-mean of an unknown name, and is recorded absolute in
// the resolved config; every broken plugin is one line on stderr and exit 2, before anything runs.
#include <gtest/gtest.h>

#include <filesystem>

#include <torch/torch.h>

#include "tests/cli/cli_test_util.h"

using namespace strobe::testing;
namespace fs = std::filesystem;

namespace {

std::string plugin(const std::string& name) {
  return fs::absolute(fs::path(bin()).parent_path().parent_path() / "lib" / "test_plugins" / ("lib" + name + ".so")).string();
}

std::string plugin_yaml(const std::string& model, const std::string& extra = "") {
  return R"(name: plugged
seed: 3
trainer:
  max_steps: 6
  max_epochs: -1
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  limit_val_batches: 0
  enable_progress_bar: false
  device: cpu
model:
  name: )" + model + R"(
  in_features: 64
  hidden: 16
  num_classes: 4
data:
  name: synthetic_images
  image_size: 8
  channels: 1
  num_classes: 4
  num_samples: 64
  num_val_samples: 16
  batch_size: 8
  num_workers: 1
optimizer:
  name: adamw
  lr: 0.01
callbacks:
  - name: consumer_step_counter
)" + extra;
}

TEST(PluginCli, APluginsComponentsTrainJoinTheListsAndAreRecorded) {
  const std::string good = plugin("plugin_good");
  ASSERT_TRUE(fs::exists(good)) << good;
  auto models = strobe_cmd("list models --plugin " + good);
  EXPECT_EQ(models.code, 0) << models.err;
  EXPECT_NE(models.out.find("consumer_gated_mlp\n"), std::string::npos) << models.out;
  EXPECT_NE(models.out.find("mlp\n"), std::string::npos) << "the built-in models are listed beside the plugin's";
  auto callbacks = strobe_cmd("list callbacks --plugin " + good);
  EXPECT_NE(callbacks.out.find("consumer_step_counter\n"), std::string::npos) << callbacks.out;

  // --plugin: trains, and the resolved config records the plugin's absolute path.
  const std::string dir = temp_dir("plugin-fit");
  auto fit = strobe_cmd("fit -c " + write_config(plugin_yaml("consumer_gated_mlp")) + " --run-dir " + dir + " --plugin " + good);
  ASSERT_EQ(fit.code, 0) << fit.err;
  EXPECT_NE(fit.out.find("consumer_step_counter: 6 steps"), std::string::npos) << fit.out;
  const std::string resolved = slurp(dir + "/config.yaml");
  EXPECT_NE(resolved.find("plugins:"), std::string::npos) << resolved;
  EXPECT_NE(resolved.find(good), std::string::npos) << resolved;

  // plugins: in the experiment, relative to the config file's directory.
  const std::string conf_dir = temp_dir("plugin-conf");
  const std::string rel = fs::relative(good, conf_dir).string();
  {
    std::ofstream f(conf_dir + "/exp.yaml");
    f << plugin_yaml("consumer_gated_mlp", "plugins: [" + rel + "]\n");
  }
  auto fit2 = strobe_cmd("fit -c " + conf_dir + "/exp.yaml --run-dir " + temp_dir("plugin-fit2"));
  EXPECT_EQ(fit2.code, 0) << fit2.err;
  EXPECT_NE(fit2.out.find("consumer_step_counter: 6 steps"), std::string::npos) << fit2.out;

  // A misspelt plugin model: the did-you-mean knows the plugin's names; without the plugin it is unknown.
  auto typo = strobe_cmd("fit -c " + write_config(plugin_yaml("consumer_gated_mpl")) + " --plugin " + good);
  EXPECT_EQ(typo.code, 2);
  EXPECT_NE(typo.err.find("did you mean 'consumer_gated_mlp'?"), std::string::npos) << typo.err;
  EXPECT_EQ(count_lines(typo.err), 1) << typo.err;
  auto missing = strobe_cmd("fit -c " + write_config(plugin_yaml("consumer_gated_mlp")));
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find("unknown model 'consumer_gated_mlp'"), std::string::npos) << missing.err;
}

TEST(PluginCli, EveryBrokenPluginIsOneLineAndExitTwoBeforeAnythingRuns) {
  const std::string dir = temp_dir("plugin-bad");
  const std::string text = dir + "/libnotes.so";
  {
    std::ofstream f(text);
    f << "not a library\n";
  }
  const std::string v = STROBE_VERSION;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {dir + "/libmissing.so", "no such file"},
      {text, "is not a shared library (build it with strobe_add_plugin)"},
      {plugin("plugin_unmarked"), "has no Strobe marker: not built with strobe_add_plugin (find_package(Strobe))"},
      {plugin("plugin_other_version"), std::string("built against Strobe 0.0.9 with libtorch ") + TORCH_VERSION +
                                           ", but this is Strobe " + v + " with libtorch " + TORCH_VERSION +
                                           ": rebuild it against this installation"},
      {plugin("plugin_duplicate"), "model 'mlp' is already registered (built in or by another plugin)"},
      {plugin("plugin_throws"), "registering 'plugin_throwing_model' threw: the lookup table is missing"},
  };
  for (const auto& [path, why] : cases) {
    auto r = strobe_cmd("list models --plugin " + path);
    EXPECT_EQ(r.code, 2) << path;
    EXPECT_EQ(r.out, "") << path;
    EXPECT_EQ(r.err, "strobe: plugin error: plugin " + path + ": " + why + "\n") << path;
  }
  // Through fit: refused before the run directory is made.
  const std::string run_dir = dir + "/run";
  auto fit = strobe_cmd("fit -c " + write_config(plugin_yaml("mlp")) + " --run-dir " + run_dir + " --plugin " +
                        plugin("plugin_duplicate"));
  EXPECT_EQ(fit.code, 2);
  EXPECT_EQ(count_lines(fit.err), 1) << fit.err;
  EXPECT_FALSE(fs::exists(run_dir)) << "a refused plugin left a run directory";
}

}  // namespace
