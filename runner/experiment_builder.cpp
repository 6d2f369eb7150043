#include "runner/experiment_builder.h"
#include "strobe/config/experiment_parse.h"
#include "strobe/core/memory_budget.h"
#include "runner/plugins.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "callbacks/profiler.h"
#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/saved_config.h"
#include "strobe/core/checkpoint_view.h"
#include "strobe/distributed/strategy.h"
#include "runner/init_from.h"
#include "runner/step_memory.h"

namespace strobe {

namespace fs = std::filesystem;

namespace {

// ema and swa each put their averages into the model for validation and restore it after: two of
// them doing so would restore each other's averages, so at most one validates on its averages.
void check_weight_averages(std::vector<config::Section>& callbacks) {
  const config::Section* validating = nullptr;
  for (auto& section : callbacks) {
    const std::string name = section.node()["name"] ? section.node()["name"].Scalar() : "";
    if (name != "ema" && name != "swa") continue;
    const YAML::Node v = section.node()["validate"];
    if (v && v.IsScalar() && v.Scalar() == "false") continue;
    if (validating)
      section.fail("validate", fmt::format("{} and {} both validate on their averages; set validate: false on one of them",
                                           validating->node()["name"].Scalar(), name));
    validating = &section;
  }
}

// trainer.strategy fsdp (docs/DISTRIBUTED.md, "fsdp"): a model that declares its units, and no
// checkpoint one process writes alone (on_exception_checkpoint: the weights are sharded over the
// processes). One line, exit 2, before the rendezvous.
void check_fsdp(config::Experiment& exp, Run& run) {
  const auto* model = dynamic_cast<const Model*>(&run.module->net());
  const YAML::Node name = exp.model.node()["name"];
  const std::string model_name = name && name.IsScalar() ? name.Scalar() : run.module->net().name();
  if (!model || model->fsdp_units().empty())
    throw config::ConfigError(fmt::format(
        "trainer.strategy: fsdp: model '{}' declares no units to shard (fsdp shards the blocks of llama, decoder_lm and "
        "vit); use zero2 or ddp",
        model_name));
  for (auto& section : exp.callbacks) {
    const std::string cb = section.node()["name"] ? section.node()["name"].Scalar() : "";
    if (cb == "on_exception_checkpoint")
      section.fail("name", "on_exception_checkpoint is not available under trainer.strategy: fsdp (the process that "
                           "fails would write the checkpoint alone, and it holds only its shard of the weights); use "
                           "zero2 or ddp");
  }
  if (exp.trainer.cuda_graphs == "true")
    throw config::ConfigError("trainer.cuda_graphs: true is not available under trainer.strategy: fsdp");
}

// A callback with all its defaults, as if the config had listed `- name: <name>`.
std::shared_ptr<Callback> default_callback(const std::string& name) {
  auto doc = config::Document::load_string("name: " + name + "\n", "<default " + name + ">");
  auto section = doc.root();
  return callback_registry().create(section, "");
}

// save_config: writes the resolved config to <run_dir>/config.yaml when fit starts — after a
// checkpoint to resume from has loaded, so a refused resume leaves the run's files as they were —
// atomically (a crash never leaves half a config), as LightningCLI's SaveConfigCallback does. It
// also removes temp files that a writer killed mid-write left in the run directory.
class SaveConfig : public Callback {
 public:
  // `yaml`: the resolved config.
  explicit SaveConfig(std::string yaml) : yaml_(std::move(yaml)) {}
  std::string name() const override { return "save_config"; }
  void on_fit_start(TrainerView& t, Module&) override {
    if (t.run_dir().empty() || !t.is_global_zero()) return;  // rank 0 alone writes run files (its claim made the directory)
    auto stale = checkpoint::remove_stale_temp_files(t.run_dir());
    if (!stale.empty())
      fmt::print(stderr, "strobe: removed {} temp file(s) a killed writer left in {}\n", stale.size(), t.run_dir());
    try {
      checkpoint::write_file_atomic(t.run_dir() + "/config.yaml", yaml_);
    } catch (const checkpoint::CheckpointError& e) {
      throw RunDirError(e.what());
    }
  }

 private:
  std::string yaml_;
};

std::optional<int64_t> model_int(config::Section& model, const std::string& key) {
  if (!model.has(key) || model.is_null(key)) return std::nullopt;
  const YAML::Node n = model.node()[key];
  if (!n.IsScalar()) return std::nullopt;
  if (!config::is_digits(n.Scalar()) || n.Scalar().size() > 18) return std::nullopt;
  return std::stoll(n.Scalar());
}

// "data.num_classes is 10" or "data 'fashion_mnist' has 10 classes".
std::string data_says(const std::string& data_name, const std::string& key, int64_t value, const std::string& noun) {
  if (!key.empty()) return fmt::format("data.{} is {}", key, value);
  return fmt::format("data '{}' has {} {}", data_name, value, noun);
}

// The estimated bytes of one training batch (from the first sample) times the batches the loader
// holds at once, against the memory left: a batch that cannot fit is refused before any allocation,
// instead of the kernel's OOM killer ending the process without a word.
void check_batch_memory(config::Section& data_cfg, DataModule& dm, uint64_t seed) {
  auto loader = dm.train_loader();
  if (!loader || loader->dataset().size() == 0) return;
  const auto& o = loader->options();
  at::Generator gen = data::sample_generator(seed, 0, 0);
  Sample s = loader->dataset().get(0, gen);
  double sample_bytes = 0;
  for (const auto& kv : s) sample_bytes += static_cast<double>(kv.second.nbytes());
  const int64_t per_batch = std::min(o.batch_size, loader->dataset().size());
  const double batch_bytes = sample_bytes * static_cast<double>(per_batch);
  // Batches queued by the workers, the one being collated (its samples and the stacked batch) and
  // the one in use.
  const int64_t held = std::max<int64_t>(1, o.num_workers * o.prefetch_factor) + 3;
  const double need = batch_bytes * static_cast<double>(held);
  const double avail = static_cast<double>(available_memory_bytes());
  if (need > avail)
    data_cfg.fail("batch_size",
                  fmt::format("{} samples of {} make a {} batch and the loader holds about {} of them ({} in all), "
                              "but only {} of memory is available; lower data.batch_size (or data.num_workers, "
                              "data.prefetch_factor)",
                              o.batch_size, human_bytes(sample_bytes), human_bytes(batch_bytes), held, human_bytes(need),
                              human_bytes(avail)));
}

}  // namespace

void check_data_fits_model(config::Section& model, const std::string& data_name, const DataInfo& d) {
  if (auto nc = model_int(model, "num_classes"); nc && d.num_classes > 0 && *nc < d.num_classes)
    model.fail("num_classes", fmt::format("{} classes, but {} (labels up to {} would be out of range)", *nc,
                                          d.num_classes_key.empty() && !d.num_classes_source.empty()
                                              ? d.num_classes_source
                                              : data_says(data_name, d.num_classes_key, d.num_classes, "classes"),
                                          d.num_classes - 1));
  if (auto ch = model_int(model, "in_channels"); ch && d.channels > 0 && *ch != d.channels)
    model.fail("in_channels", fmt::format("{} input channels, but {}", *ch,
                                          data_says(data_name, d.channels_key, d.channels, "image channels")));
  for (const char* key : {"image_size", "img_size"})
    if (auto sz = model_int(model, key); sz && d.image_size > 0 && *sz != d.image_size)
      model.fail(key, fmt::format("{} pixels, but {}", *sz,
                                  data_says(data_name, d.image_size_key, d.image_size, "pixels per side")));
  if (auto f = model_int(model, "in_features"); f && d.channels > 0 && d.image_size > 0) {
    const int64_t n = d.channels * d.image_size * d.image_size;
    if (*f != n)
      model.fail("in_features",
                 fmt::format("{}, but the data's images flatten to {} x {} x {} = {} ({}, {})", *f, d.channels, d.image_size,
                             d.image_size, n, data_says(data_name, d.channels_key, d.channels, "channels"),
                             data_says(data_name, d.image_size_key, d.image_size, "pixels per side")));
  }
  if (d.flat_features)
    for (const char* key : {"img_size", "image_size", "in_channels"})
      if (model.has(key))
        model.fail(key, fmt::format("model '{}' reads images, but data '{}' gives flat vectors of {} values per sample "
                                    "(an mlp with in_features: {} reads them)",
                                    model.node()["name"].IsScalar() ? model.node()["name"].Scalar() : "?", data_name,
                                    d.feature_width, d.feature_width));
  if (auto f = model_int(model, "in_features"); f && d.feature_width > 0 && *f != d.feature_width)
    model.fail("in_features", fmt::format("{}, but {}", *f,
                                          data_says(data_name, d.feature_width_key, d.feature_width, "values per sample")));
  if (auto w = model_int(model, "num_classes"); w && d.target_width > 0 && *w != d.target_width)
    model.fail("num_classes", fmt::format("{} outputs per sample, but the regression target holds {} value{} per sample (one "
                                          "output per target value: a loss would broadcast the two shapes silently)",
                                          *w, d.target_width, d.target_width == 1 ? "" : "s"));
  if (auto v = model_int(model, "vocab_size"); v && d.vocab_size > 0 && *v < d.vocab_size)
    model.fail("vocab_size", fmt::format("{} tokens, but {} (token ids up to {} would be out of range)", *v,
                                         d.vocab_size_key.empty() && !d.vocab_size_source.empty()
                                             ? d.vocab_size_source
                                             : data_says(data_name, d.vocab_size_key, d.vocab_size, "token ids"),
                                         d.vocab_size - 1));
  if (auto l = model_int(model, "max_seq_len"); l && d.max_seq_len > 0 && *l < d.max_seq_len)
    model.fail("max_seq_len", fmt::format("{} positions, but {} (longer sequences have no position embedding)", *l,
                                          data_says(data_name, d.max_seq_len_key, d.max_seq_len, "positions")));
}

static void check_batch_keys(config::Experiment& exp, const DataInfo& d, const Model& model, const Module& task) {
  if (d.batch_keys.empty()) return;  // a data module that does not declare its keys
  auto lacking = [&](const std::vector<std::string>& wanted) -> std::string {
    for (const auto& k : wanted)
      if (std::find(d.batch_keys.begin(), d.batch_keys.end(), k) == d.batch_keys.end()) return k;
    return "";
  };
  const std::string data_name = exp.data.node()["name"].Scalar();
  const std::string gives = fmt::format("{}", fmt::join(d.batch_keys, ", "));
  if (const std::string k = lacking(model.batch_keys()); !k.empty())
    exp.model.fail("name", fmt::format("'{}' reads '{}' from each batch, but the batches of data '{}' hold {}",
                                       exp.model.node()["name"].Scalar(), k, data_name, gives));
  if (const std::string k = lacking(task.batch_keys()); !k.empty()) {
    const bool named = exp.task.has("name");
    const std::string what = fmt::format("task '{}' reads '{}' from each batch, but the batches of data '{}' hold {}",
                                         named ? exp.task.node()["name"].Scalar() : model.default_task(), k,
                                         data_name, gives);
    if (named) exp.task.fail("name", what);
    exp.model.fail("name", what + " (the model's default task; set task.name)");
  }
}

namespace {

// The checkpoint a command starts from (--ckpt), read once, and its saved config parsed once.
struct RunCheckpoint {
  std::optional<checkpoint::CheckpointData> data;
  std::shared_ptr<const config::SavedConfig> config;
};

// Before any component is built: reads --ckpt (a bad one is refused before any work) and loads the
// plugins the config names and the checkpoint recorded, whose components join the registries; the
// resolved config records each plugin with its hash.
RunCheckpoint read_checkpoint_and_load_plugins(config::Document& doc, Run& run, const RunOptions& options,
                                               const distributed::LaunchEnv& env) {
  auto& exp = run.experiment;
  // Before any component is built: the plugins' components join the registries (runner/plugins.h).
  // A checkpoint (read here first, so a bad one is refused before any work) brings the plugins it
  // was written with, at their recorded hashes.
  std::vector<config::PluginSpec> plugins = exp.plugins;
  // Read once: the trainer is handed the loaded checkpoint below instead of reading it again.
  // Its saved config is parsed once: its plugins here, the resume check's comparison in the trainer.
  RunCheckpoint ckpt;
  if (options.ckpt) {
    ckpt.data = checkpoint::load_checkpoint_file(*options.ckpt);
    if (const std::string* saved = CheckpointView(*ckpt.data, *options.ckpt).config()) {
      ckpt.config = std::make_shared<const config::SavedConfig>(*saved, *options.ckpt);
      plugins = with_recorded_plugins(plugins, ckpt.config->plugins());
    }
  }
  if (!plugins.empty()) {
    YAML::Node record(YAML::NodeType::Sequence);
    exp.plugins.clear();
    for (const auto& p : load_plugins(plugins, options.allow_changed_plugins)) {
      if (!p.changed.empty()) {
        if (env.rank == 0) fmt::print(stderr, "strobe: {}\n", p.changed);
        run.plugin_changes.push_back(p.changed);
      }
      YAML::Node entry;
      entry["path"] = p.spec.path;
      entry["sha256"] = p.spec.sha256;
      if (!p.spec.replaced_sha256.empty()) entry["replaced_sha256"] = p.spec.replaced_sha256;
      record.push_back(entry);
      exp.plugins.push_back(p.spec);
    }
    doc.root().node()["plugins"] = record;
  }
  return ckpt;
}

// The data module, the model (its shape maybe filled from a Hugging Face config.json, its weights
// from model.init_from), the task and the callbacks (the configured ones, then the defaults the
// trainer.enable_* switches turn on). Returns the config.json the initial weights came with.
std::optional<std::string> build_components(Run& run, const RunOptions& options, const distributed::LaunchEnv& env,
                                            const std::optional<checkpoint::CheckpointData>& ckpt_data) {
  auto& exp = run.experiment;
  DataContext ctx;
  ctx.seed = static_cast<uint64_t>(exp.seed);
  // The distributed sampler: rank r takes its stride of every epoch's permutation.
  ctx.rank = env.rank;
  ctx.world_size = env.world_size;
  ctx.pin_memory = false;  // the trainer turns pinning on when it trains on CUDA

  // Models draw their initial weights from the global generator: seed it before building them so a
  // run's initialization depends only on `seed`.
  torch::manual_seed(static_cast<uint64_t>(exp.seed));
  run.datamodule = data_registry().create(exp.data, "", ctx);
  if (options.stage == Stage::Fit) check_batch_memory(exp.data, *run.datamodule, ctx.seed);
  // model.init_from with names: hf: the shape keys the section leaves unset come from the
  // checkpoint's config.json, so the model is built to fit it and the resolved config records them.
  // With --ckpt, from the config.json the checkpoint recorded (the directory may be gone since).
  std::vector<std::string> filled;
  std::string filled_from;
  if (exp.init_from && !options.ckpt) {
    filled = fill_from_hf_config(exp.model, *exp.init_from);
    filled_from = exp.init_from->path + "/config.json";
  } else if (exp.init_from && ckpt_data) {
    if (const std::string* hf = CheckpointView(*ckpt_data, *options.ckpt).hf_config()) {
      filled = fill_from_recorded_hf_config(exp.model, *exp.init_from, *hf, *options.ckpt);
      filled_from = "the config.json " + *options.ckpt + " recorded";
    }
  }
  std::shared_ptr<Model> model;
  try {
    model = model_registry().create(exp.model, "");
  } catch (const config::ConfigError& e) {
    if (filled.empty()) throw;
    // A shape the model refuses (one it cannot build, or too large for this machine) came from there.
    throw config::ConfigError(fmt::format("{} (model.{} from {})", e.what(), fmt::join(filled, ", model."), filled_from));
  }
  std::optional<std::string> hf_source_config;  // the Hugging Face config.json the weights came with
  check_data_fits_model(exp.model, exp.data.node()["name"].Scalar(), run.datamodule->info());
  if (exp.init_from) {
    if (options.ckpt) {
      if (env.rank == 0)
        fmt::print(stderr, "strobe: model.init_from ({}) is ignored: the weights come from --ckpt {}\n",
                   exp.init_from->path, *options.ckpt);
    } else {
      hf_source_config = load_init_from(*model, exp.model, *exp.init_from, env.rank == 0);
    }
  }
  run.module = task_registry().create(exp.task, model->default_task(), model);
  check_batch_keys(exp, run.datamodule->info(), *model, *run.module);
  run.module->on_data_info(run.datamodule->info());

  for (auto& section : exp.callbacks) run.callbacks.push_back(callback_registry().create(section, ""));
  check_weight_averages(exp.callbacks);
  // As in Lightning: a fit adds the callbacks its trainer.enable_* switches turn on when none of that
  // name is configured (a default model_checkpoint keeps last.ckpt and the latest epoch's checkpoint).
  if (options.stage == Stage::Predict && exp.trainer.enable_progress_bar &&
      std::none_of(run.callbacks.begin(), run.callbacks.end(), [](const auto& cb) { return cb->name() == "progress_bar"; }))
    run.callbacks.push_back(default_callback("progress_bar"));  // strobe predict shows its progress too
  if (options.stage == Stage::Fit) {
    const size_t configured = run.callbacks.size();
    for (const auto& [enabled, default_name] : {std::pair{exp.trainer.enable_checkpointing, "model_checkpoint"},
                                                std::pair{exp.trainer.enable_progress_bar, "progress_bar"},
                                                std::pair{exp.trainer.enable_model_summary, "model_summary"}}) {
      const std::string name = default_name;
      const auto end = run.callbacks.begin() + static_cast<std::ptrdiff_t>(configured);
      if (enabled && std::none_of(run.callbacks.begin(), end, [&](const auto& cb) { return cb->name() == name; }))
        run.callbacks.push_back(default_callback(name));
    }
  }

  return hf_source_config;
}

// The run directory (docs/CONFIG.md, "Run directory"), claimed by rank 0 and told to the others,
// with the callbacks' checkpoint directories outside it; none for a fast_dev_run without --run-dir.
void claim_run_directory(Run& run, const RunOptions& options) {
  auto& exp = run.experiment;
  auto& strategy = *run.strategy;
  // trainer.fast_dev_run writes no files (no checkpoints, logs or config.yaml): it claims no
  // version_<n>, and a run directory only when --run-dir names one.
  if (options.create_run_dir && (exp.trainer.fast_dev_run == 0 || options.run_dir)) {
    // Rank 0 alone picks (next_version_dir would race between ranks) and checks the run directory,
    // then tells the others its name, or its error: every rank then ends with the same exit 2.
    // The claim (docs/CONFIG.md, "Run directory"): a version_<n> taken with mkdir, a lock held while
    // the run lives, and a directory holding another run refused unless resumed or --overwrite.
    std::string error;
    if (strategy.is_global_zero()) {
      try {
        std::string origin;
        if (options.run_dir) {
          run.claim = std::make_shared<RunDirClaim>(RunDirClaim::at(*options.run_dir, "--run-dir"));
          origin = "--run-dir";
        } else if (options.ckpt && options.stage == Stage::Fit) {
          fs::path ck = fs::absolute(*options.ckpt);
          if (ck.parent_path().filename() == "checkpoints" && fs::exists(ck.parent_path().parent_path() / "config.yaml")) {
            origin = "the run directory of --ckpt,";
            run.claim = std::make_shared<RunDirClaim>(RunDirClaim::at(ck.parent_path().parent_path().string(), origin));
          }
        }
        if (!run.claim) {
          origin = "trainer.default_root_dir:";
          run.claim = std::make_shared<RunDirClaim>(RunDirClaim::next_version(exp.trainer.default_root_dir, exp.name));
        }
        check_run_dir_free(*run.claim, origin, options.stage == Stage::Fit ? options.ckpt : std::nullopt, options.overwrite);
        run.run_dir = run.claim->dir();
        // A callback's checkpoint directory outside the run directory is claimed as the run directory
        // is (docs/CONFIG.md, "Run directory"): never another run's, locked while this run lives. The
        // configured callbacks come first in run.callbacks, in their config order.
        std::set<std::string> claimed;
        for (size_t i = 0; i < run.callbacks.size(); ++i) {
          const std::string dirpath = run.callbacks[i]->checkpoint_dir();
          if (dirpath.empty() || !claimed.insert(fs::absolute(dirpath).lexically_normal().string()).second) continue;
          const std::string origin = i < exp.callbacks.size() ? exp.callbacks[i].key_path("dirpath") + ":"
                                                              : run.callbacks[i]->name() + ": checkpoint directory";
          auto c = CheckpointDirClaim::claim(dirpath, run.run_dir, origin,
                                             options.stage == Stage::Fit ? options.ckpt : std::nullopt, options.overwrite);
          if (c) run.checkpoint_dirs.push_back(std::move(c));
        }
      } catch (const RunDirError& e) {
        if (strategy.world_size() == 1) throw;
        error = e.what();
      }
    }
    if (strategy.world_size() > 1) {
      const std::string got = strategy.broadcast_string(error.empty() ? run.run_dir : "\x01" + error);
      if (!got.empty() && got[0] == '\x01') {
        strategy.shutdown();
        throw RunDirError(got.substr(1));
      }
      run.run_dir = got;
    }
  }

}

}  // namespace

std::unique_ptr<Run> build_run(config::Document& doc, const RunOptions& options) {
  auto run = std::make_unique<Run>();
  run->experiment = config::parse_experiment(doc);
  auto& exp = run->experiment;
  const distributed::LaunchEnv env = options.launch_env ? *options.launch_env : distributed::launch_env_from_process();
  RunCheckpoint ckpt = read_checkpoint_and_load_plugins(doc, *run, options, env);
  const std::optional<std::string> hf_source_config = build_components(*run, options, env, ckpt.data);

  // The strategy once every component is built (a config or data error is then refused on every
  // rank before any rendezvous, exit 2 without a word from the others): under torchrun / Slurm it is
  // the rendezvous of every process of the job (bad device: ConfigError, exit 2; a rendezvous that
  // does not complete within trainer.dist_timeout: DistributedError naming the rank, exit 1).
  distributed::StrategyOptions so;
  so.device = exp.trainer.device;
  so.timeout = std::chrono::milliseconds(static_cast<int64_t>(exp.trainer.dist_timeout_s * 1000.0));
  so.zero2 = exp.trainer.strategy == "zero2" || exp.trainer.strategy == "fsdp";
  so.fsdp = exp.trainer.strategy == "fsdp";
  if (so.fsdp) check_fsdp(exp, *run);
  run->strategy = distributed::make_strategy(so, env);
  auto& strategy = *run->strategy;
  // The training step's memory at data.batch_size, measured on a small trial before anything is
  // written (runner/step_memory.h).
  if (options.stage == Stage::Fit) {
    run->step_memory = measure_step_memory(exp, *run->datamodule, *run->module, strategy.device(), strategy.world_size());
    if (run->step_memory) check_step_memory(exp.data, *run->step_memory);
  }

  claim_run_directory(*run, options);

  // Per process: every rank of a multi-process run writes its own trace (<host>_<pid> names).
  if (exp.trainer.profiler.enabled && options.stage == Stage::Fit) {
    const auto& p = exp.trainer.profiler;
    const std::string dir = !p.path.empty() ? p.path : run->run_dir.empty() ? "profiler" : run->run_dir + "/profiler";
    run->callbacks.push_back(make_profiler_callback(p, dir));
  }

  // Every section has been read (the components, the optimizer and scheduler with the experiment):
  // the resolved config is whole.
  run->resolved_yaml = doc.emit();
  if (!run->run_dir.empty()) run->callbacks.push_back(std::make_shared<SaveConfig>(run->resolved_yaml));
  for (auto& cb : options.extra_callbacks) run->callbacks.push_back(cb);

  TrainerParts parts;
  parts.experiment = exp;
  parts.resolved_config = run->resolved_yaml;
  parts.checkpoint_config = std::move(ckpt.config);
  parts.module = run->module;
  parts.datamodule = run->datamodule;
  parts.callbacks = run->callbacks;
  parts.run_dir = run->run_dir;
  parts.strategy = run->strategy;
  if (hf_source_config) parts.hf_source_config = *hf_source_config;
  if (options.on_device) options.on_device(strategy.device());
  run->trainer = std::make_unique<Trainer>(std::move(parts));
  run->checkpoint = std::move(ckpt.data);
  return run;
}

config::Document compose_experiment(const std::vector<std::string>& configs, const std::vector<std::string>& sets,
                                    const std::vector<std::string>& plugins) {
  auto doc = config::Document::load_files(configs);
  for (const auto& s : sets) doc.apply_override(s);
  add_plugins_to(doc, plugins);
  return doc;
}

void make_probe_run(config::Document& doc) {
  for (const char* s : {"trainer.max_epochs=-1", "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false",
                        "trainer.enable_model_summary=false", "callbacks=[]"})
    doc.apply_override(s);
}

}  // namespace strobe
