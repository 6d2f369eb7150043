// Plugins (runner/plugins.h): a component library built like a user's (tests/cli/plugins) trains
// through `strobe fit --plugin` and through `plugins:` in the experiment (relative to the config
// file), joins `strobe list` and the did-you-mean of an unknown name, and is recorded absolute in
// the resolved config; every broken plugin is one line on stderr and exit 2, before anything runs.
// Checkpoints and NaN captures record each plugin with its SHA-256: resume, validate and replay load
// them again, and refuse a changed or missing one (naming it and both hashes) unless
// --allow-changed-plugins, which goes on, says so once and records the change.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/sha256.h"
#include "runner/plugins.h"
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
  // Nothing close among the known names: the hint says where a plugin's component comes from.
  EXPECT_NE(missing.err.find("; a plugin's? load its library with --plugin FILE or a plugins: entry\n"), std::string::npos)
      << missing.err;
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
      {dir, "is a directory, not a shared library file"},
      {text, "is not a shared library (build it with strobe_add_plugin)"},
      {plugin("plugin_unmarked"), "has no Strobe marker: not built with strobe_add_plugin (find_package(Strobe))"},
      // Binary junk in the marker section: escaped, one line.
      {plugin("plugin_junk_marker"),
       "its Strobe marker '\\x01\\x7f\\xff\\xfe\\nsecond line\\x1b[31m' cannot be read (rebuild it with strobe_add_plugin)"},
      {plugin("plugin_other_version"), std::string("built against Strobe 0.0.9 with libtorch ") + TORCH_VERSION +
                                           ", but this is Strobe " + v + " with libtorch " + TORCH_VERSION +
                                           ": rebuild it against this installation"},
      {plugin("plugin_other_headers"), std::string("built against other Strobe headers (fingerprint 0123456789abcdef, this "
                                                   "Strobe's ") + strobe::built_headers_fingerprint() +
                                           "): its classes may not match this Strobe's; rebuild it against this installation"},
      {plugin("plugin_old_cxx_abi"), "built for the C++ library ABI libstdc++-old, but this Strobe uses libstdc++-cxx11: "
                                     "rebuild it against this installation with the same C++ library (for libstdc++: "
                                     "_GLIBCXX_USE_CXX11_ABI=1)"},
      {plugin("plugin_duplicate"), "model 'mlp' is already registered (built in or by another plugin)"},
      {plugin("plugin_throws"), "registering 'plugin_throwing_model' threw: the lookup table is missing"},
      // Thrown outside a registration: std::terminate would abort; the handler names it, exit 2.
      {plugin("plugin_initialiser_throws"), "a static initialiser threw while it loaded: cannot read plugin_settings.json"},
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
  // An entry of `plugins:` in the experiment is named by its file, line and column.
  const std::string yaml = plugin_yaml("mlp", "plugins: [" + dir + "/libmissing.so]\n");
  const size_t line = std::count(yaml.begin(), yaml.begin() + yaml.find("plugins: ["), '\n') + 1;
  const std::string cfg = write_config(yaml);
  fit = strobe_cmd("fit -c " + cfg + " --run-dir " + run_dir);
  EXPECT_EQ(fit.code, 2);
  EXPECT_EQ(fit.err, "strobe: plugin error: " + cfg + ":" + std::to_string(line) + ":11: plugins[0]: plugin " + dir +
                         "/libmissing.so: no such file\n");
  EXPECT_FALSE(fs::exists(run_dir));
}

std::string copy_plugin(const std::string& dir) {
  fs::create_directories(dir);
  const std::string to = dir + "/libplugin_good.so";
  fs::copy_file(plugin("plugin_good"), to, fs::copy_options::overwrite_existing);
  return to;
}

// Another build of the plugin: still a loadable library, with other bytes (so another hash).
void change_plugin(const std::string& path) {
  std::ofstream(path, std::ios::binary | std::ios::app) << "rebuilt";
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(PluginCli, CheckpointsRecordPluginHashesAndResumeRefusesAChangedOrMissingPlugin) {
  const std::string dir = temp_dir("plugin-hash");
  const std::string lib = copy_plugin(dir + "/lib");
  const std::string before = strobe::checkpoint::sha256_file(lib);
  const std::string run = dir + "/run";
  auto fit = strobe_cmd("fit -c " + write_config(plugin_yaml("consumer_gated_mlp")) + " --run-dir " + run + " --plugin " + lib);
  ASSERT_EQ(fit.code, 0) << fit.err;
  const std::string record = "- path: " + lib + "\n    sha256: " + before;
  EXPECT_NE(slurp(run + "/config.yaml").find(record), std::string::npos) << slurp(run + "/config.yaml");
  const std::string ckpt = run + "/checkpoints/last.ckpt";
  EXPECT_NE(strobe::checkpoint::load_checkpoint_file(ckpt).blob("config").find(record), std::string::npos);

  // The resume names no plugin: the checkpoint's is loaded again (its model and callback build, and
  // the callback's count goes on from the checkpoint's 6).
  const std::string longer = write_config(plugin_yaml("consumer_gated_mlp") + "");
  auto resume = strobe_cmd("fit -c " + longer + " --ckpt " + ckpt + " --set trainer.max_steps=8");
  ASSERT_EQ(resume.code, 0) << resume.err;
  EXPECT_NE(resume.out.find("consumer_step_counter: 8 steps"), std::string::npos) << resume.out;
  auto val = strobe_cmd("validate -c " + longer + " --ckpt " + ckpt);
  EXPECT_EQ(val.code, 0) << val.err;

  // export: its own names need no plugin; another name set builds the model, through the plugin the
  // checkpoint recorded (loaded by export itself), and asks it for that name set.
  auto exported = strobe_cmd("export " + ckpt + " -o " + dir + "/w.safetensors");
  EXPECT_EQ(exported.code, 0) << exported.err;
  auto timm = strobe_cmd("export " + ckpt + " -o " + dir + "/t.safetensors --names timm");
  EXPECT_EQ(timm.code, 2);
  EXPECT_EQ(timm.err, "strobe export: --names timm: model 'consumer_gated_mlp' has no name set 'timm' (it has: strobe)\n");

  change_plugin(lib);
  const std::string after = strobe::checkpoint::sha256_file(lib);
  ASSERT_NE(before, after);
  const std::string changed = "strobe: plugin error: plugin " + lib + ": changed since " + ckpt + " recorded it (sha256 " +
                              before + " there, " + after + " now): rebuild the plugin the run was made with, or pass "
                              "--allow-changed-plugins to go on with this one\n";
  for (const std::string cmd : {"fit", "validate", "test"}) {
    auto r = strobe_cmd(cmd + " -c " + longer + " --ckpt " + ckpt + " --set trainer.max_steps=10");
    EXPECT_EQ(r.code, 2) << cmd;
    EXPECT_EQ(r.err, changed) << cmd;
  }
  // The same when the experiment names the plugin itself (its hash is the checkpoint's to check).
  auto named = strobe_cmd("fit -c " + longer + " --ckpt " + ckpt + " --plugin " + lib + " --set trainer.max_steps=10");
  EXPECT_EQ(named.code, 2);
  EXPECT_EQ(named.err, changed);

  // Allowed: said once, the run goes on with the new plugin, and its config and checkpoints record
  // both hashes (a further resume with the same file then passes without the flag).
  auto allowed = strobe_cmd("fit -c " + longer + " --ckpt " + ckpt + " --allow-changed-plugins --set trainer.max_steps=10");
  ASSERT_EQ(allowed.code, 0) << allowed.err;
  EXPECT_EQ(count_of(allowed.err, "changed since"), 1u) << allowed.err;
  EXPECT_NE(allowed.err.find("going on with it (--allow-changed-plugins)"), std::string::npos) << allowed.err;
  EXPECT_NE(allowed.out.find("consumer_step_counter: 10 steps"), std::string::npos) << allowed.out;
  const std::string now = "- path: " + lib + "\n    sha256: " + after + "\n    replaced_sha256: " + before;
  EXPECT_NE(slurp(run + "/config.yaml").find(now), std::string::npos) << slurp(run + "/config.yaml");
  EXPECT_NE(strobe::checkpoint::load_checkpoint_file(ckpt).blob("config").find(now), std::string::npos);
  auto again = strobe_cmd("fit -c " + longer + " --ckpt " + ckpt + " --set trainer.max_steps=12");
  EXPECT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(again.err.find("changed since"), std::string::npos) << again.err;

  // Missing: one line naming the plugin and the checkpoint that recorded it, flag or not.
  fs::rename(lib, lib + ".gone");
  for (const std::string flag : {"", " --allow-changed-plugins"}) {
    auto r = strobe_cmd("fit -c " + longer + " --ckpt " + ckpt + " --set trainer.max_steps=14" + flag);
    EXPECT_EQ(r.code, 2) << flag;
    EXPECT_EQ(r.err, "strobe: plugin error: plugin " + lib + ": no such file (recorded by " + ckpt + ")\n") << flag;
  }
}

TEST(PluginCli, ReplayLoadsTheCapturesPluginAndRefusesAChangedOne) {
  const std::string dir = temp_dir("plugin-replay");
  const std::string lib = copy_plugin(dir + "/lib");
  const std::string before = strobe::checkpoint::sha256_file(lib);
  // per_class_bce over 4 classes with batches of 2: a class is absent from the first batch, so its
  // loss is 0/0 and the NaN capture stops the run there.
  std::string yaml = plugin_yaml("consumer_gated_mlp", "task:\n  name: classification\n  loss: per_class_bce\n");
  yaml.replace(yaml.find("batch_size: 8"), 13, "batch_size: 2");
  const std::string callbacks = "  - name: consumer_step_counter\n";
  yaml.replace(yaml.find(callbacks), callbacks.size(), callbacks + "  - name: nan_capture\n");
  const std::string run = dir + "/run";
  auto fit = strobe_cmd("fit -c " + write_config(yaml) + " --run-dir " + run + " --plugin " + lib);
  ASSERT_EQ(fit.code, 3) << fit.err;
  auto replay = strobe_cmd("replay " + run + "/nan --report " + dir + "/r.json");
  ASSERT_EQ(replay.code, 0) << replay.err;
  auto report = nlohmann::json::parse(slurp(dir + "/r.json"));
  EXPECT_TRUE(report.at("exact").get<bool>()) << report.dump(1);
  EXPECT_EQ(report.at("first_nonfinite").at("module").get<std::string>(), "task.loss") << report.dump(1);

  change_plugin(lib);
  const std::string after = strobe::checkpoint::sha256_file(lib);
  auto refused = strobe_cmd("replay " + run + "/nan");
  EXPECT_EQ(refused.code, 2);
  EXPECT_EQ(count_lines(refused.err), 1) << refused.err;
  EXPECT_NE(refused.err.find("plugin " + lib + ": changed since "), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("(sha256 " + before + " there, " + after + " now)"), std::string::npos) << refused.err;
  auto allowed = strobe_cmd("replay " + run + "/nan --allow-changed-plugins --report " + dir + "/r2.json");
  ASSERT_EQ(allowed.code, 0) << allowed.err;
  EXPECT_EQ(count_of(allowed.err, "changed since"), 1u) << allowed.err;
  const auto notes = nlohmann::json::parse(slurp(dir + "/r2.json")).at("notes").dump();
  EXPECT_NE(notes.find("changed since"), std::string::npos) << notes;
}

}  // namespace

// A plugin's components misbehaving at run time: a hook throwing what is not a std::exception ends
// the run as any error does (one line naming the callback and the hook, exit 1, the exception
// checkpoint written), never `terminate`; a model's wrong depth order is one line and exit 2 at setup.
TEST(PluginCli, AMisbehavingPluginIsOneLineNeverATerminate) {
  const std::string bad = plugin("plugin_misbehaving") + " --plugin " + plugin("plugin_good");  // good: the step counter
  ASSERT_TRUE(fs::exists(plugin("plugin_misbehaving")));
  const std::string dir = temp_dir("plugin-misbehaving");
  const std::string yaml = plugin_yaml("mlp", "  - {name: misbehaving_throws_int, at_step: 2}\n  - name: on_exception_checkpoint\n");
  auto r = strobe_cmd("fit -c " + write_config(yaml) + " --run-dir " + dir + "/throws --plugin " + bad + " --set model.hidden=[16]");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("strobe: error: callback 'misbehaving_throws_int': on_train_batch_start threw an exception that is not "
                       "a std::exception\n"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(dir + "/throws/checkpoints/on_exception.ckpt")) << r.err;

  const std::string layered = plugin_yaml("misbehaving_bad_layers");
  for (const auto& [sets, expect] : std::vector<std::pair<std::string, std::string>>{
           {"--set model.layers=4611686018427387904",
            "layer_decay: model 'BadLayers' declares 4611686018427387904 layers (num_layers()), more than its 2 "
            "parameter tensors could fill"},
           {"--set model.weight_layer=7",
            "layer_decay: model 'BadLayers' puts parameter 'fc.weight' in layer 7 (layer_of()), outside [0, 2)"},
       }) {
    auto res = strobe_cmd("fit -c " + write_config(layered) + " --run-dir " + dir + "/layers --plugin " + bad +
                          " --set 'optimizer.param_groups={layer_decay: 0.5}' " + sets);
    EXPECT_EQ(res.code, 2) << sets << "\n" << res.err;
    EXPECT_NE(res.err.find(expect), std::string::npos) << sets << "\n" << res.err;
    EXPECT_EQ(std::count(res.err.begin(), res.err.end(), '\n'), 1) << res.err;
  }

  // Declared training FLOPs of inf, NaN or below zero are no declaration: no TFLOP/s or utilisation.
  for (const std::string flops : {"1e6", "inf", "nan", "-1"}) {
    const std::string run = dir + "/flops_" + flops;
    auto res = strobe_cmd("fit -c " + write_config(layered) + " --run-dir " + run + " --plugin " + bad + " --set model.flops=" +
                          flops + " --set 'callbacks=[{name: throughput_monitor, every_n_steps: 2, peak_tflops: 1}]'");
    ASSERT_EQ(res.code, 0) << flops << "\n" << res.err;
    const std::string csv = slurp(run + "/metrics.csv");
    EXPECT_EQ(csv.find("throughput/mfu") != std::string::npos, flops == "1e6") << flops << "\n" << csv;
  }
}
