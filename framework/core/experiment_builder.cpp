#include "framework/core/experiment_builder.h"

#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <torch/torch.h>

namespace strobe {

namespace fs = std::filesystem;

std::string next_version_dir(const std::string& root, const std::string& name) {
  fs::path base = fs::path(root) / name;
  int64_t next = 0;
  if (fs::is_directory(base)) {
    for (const auto& e : fs::directory_iterator(base)) {
      std::string n = e.path().filename().string();
      if (n.rfind("version_", 0) == 0) {
        try {
          next = std::max<int64_t>(next, std::stoll(n.substr(8)) + 1);
        } catch (const std::exception&) {
        }
      }
    }
  }
  return (base / fmt::format("version_{}", next)).string();
}

namespace {
// A callback with all its defaults, as if the config had listed `- name: <name>`.
std::shared_ptr<Callback> default_callback(const std::string& name) {
  auto doc = config::Document::load_string("name: " + name + "\n", "<default " + name + ">");
  auto section = doc.root();
  return callback_registry().create(section, "");
}
}  // namespace

std::unique_ptr<Run> build_run(config::Document& doc, const RunOptions& options) {
  auto run = std::make_unique<Run>();
  run->experiment = config::parse_experiment(doc);
  auto& exp = run->experiment;

  DataContext ctx;
  ctx.seed = static_cast<uint64_t>(exp.seed);
  if (const char* r = std::getenv("RANK")) ctx.rank = std::atoll(r);
  if (const char* w = std::getenv("WORLD_SIZE")) ctx.world_size = std::max<int64_t>(1, std::atoll(w));
  if (ctx.world_size > 1)
    throw config::ConfigError(fmt::format(
        "WORLD_SIZE={}: multi-process training is not part of this build yet (run one process per job)", ctx.world_size));
  ctx.pin_memory = false;  // the trainer turns pinning on when it trains on CUDA

  // Models draw their initial weights from the global generator: seed it before building them so a
  // run's initialization depends only on `seed`.
  torch::manual_seed(static_cast<uint64_t>(exp.seed));
  run->datamodule = data_registry().create(exp.data, "", ctx);
  auto model = model_registry().create(exp.model, "");
  run->module = task_registry().create(exp.task, model->default_task(), model);

  bool has_progress = false, has_checkpoint = false;
  for (auto& section : exp.callbacks) {
    run->callbacks.push_back(callback_registry().create(section, ""));
    has_progress |= run->callbacks.back()->name() == "progress_bar";
    has_checkpoint |= run->callbacks.back()->name() == "model_checkpoint";
  }
  // As in Lightning: with checkpointing enabled and none configured, a default model_checkpoint
  // keeps last.ckpt (and the latest epoch's checkpoint).
  if (exp.trainer.enable_checkpointing && !has_checkpoint && options.stage == Stage::Fit)
    run->callbacks.push_back(default_callback("model_checkpoint"));
  if (exp.trainer.enable_progress_bar && !has_progress && options.stage == Stage::Fit)
    run->callbacks.push_back(default_callback("progress_bar"));

  if (options.create_run_dir) {
    if (options.run_dir) {
      run->run_dir = *options.run_dir;
    } else if (options.ckpt && options.stage == Stage::Fit) {
      fs::path ck = fs::absolute(*options.ckpt);
      if (ck.parent_path().filename() == "checkpoints" && fs::exists(ck.parent_path().parent_path() / "config.yaml"))
        run->run_dir = ck.parent_path().parent_path().string();
    }
    if (run->run_dir.empty()) run->run_dir = next_version_dir(exp.trainer.default_root_dir, exp.name);
  }

  run->trainer = std::make_unique<Trainer>(exp, "", run->module, run->datamodule, run->callbacks, run->run_dir);
  if (options.stage == Stage::Fit) run->trainer->setup_for_fit();  // reads optimizer/scheduler keys
  run->resolved_yaml = doc.emit();
  run->trainer->set_resolved_config(run->resolved_yaml);
  if (!run->run_dir.empty()) {
    fs::create_directories(run->run_dir);
    std::ofstream(fs::path(run->run_dir) / "config.yaml") << run->resolved_yaml;
  }
  return run;
}

}  // namespace strobe
