// strobe: the command line (CONFIG.md). Exit status: 0 success; 2 bad usage, config, checkpoint,
// capture or data argument or run directory, or data that cannot fit the model or the memory, all
// found before training starts (one message on stderr); 3 stopped by a NaN capture; 130/143
// interrupted by SIGINT/SIGTERM after saving last.ckpt; 1 any other failure, running out of memory
// during the run (one line naming the setting to lower) and a write that fails for want of disk,
// quota or file size (one line naming the file) included.
#include <algorithm>
#include <string_view>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <new>

#include <nlohmann/json.hpp>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "bench/lib/bench.h"
#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/config.h"
#include "strobe/core/callback.h"
#include "strobe/core/capture.h"
#include "strobe/core/quarantine.h"
#include "strobe/core/datamodule.h"
#include "strobe/core/model.h"
#include "strobe/core/module.h"
#include "strobe/metrics/registry.h"
#include "strobe/core/signals.h"
#include "strobe/data/data_error.h"
#include "strobe/distributed/launch_env.h"
#include "runner/command_inputs.h"
#include "runner/experiment_builder.h"
#include "runner/export.h"
#include "runner/predict.h"
#include "runner/plugins.h"
#include "runner/hang.h"
#include "strobe/logging/mlflow_logger.h"
#include "runner/lr_find.h"
#include "bench/lib/batch_size_finder.h"
#include "runner/replay.h"

namespace {

std::string version_string() {
  std::string cuda = torch::cuda::is_available() ? fmt::format("CUDA, {} device(s) visible", torch::cuda::device_count())
                                                 : "no CUDA device visible";
  return fmt::format("strobe {} (libtorch {}; {})", STROBE_VERSION, TORCH_VERSION, cuda);
}

// A number option: finite, and above (or at least) zero; one short line otherwise, never CLI11's
// "Value 0 not in range 0.000000 to 1797693134862315...".
CLI::Validator number_above_zero(bool zero_allowed) {
  return CLI::Validator(
      [zero_allowed](std::string& v) -> std::string {
        const char* what = zero_allowed ? "a number of 0 or more" : "a number above 0";
        try {
          size_t used = 0;
          const double x = std::stod(v, &used);
          if (used != v.size() || !std::isfinite(x) || (zero_allowed ? x < 0 : x <= 0))
            return fmt::format("expected {}, got '{}'", what, v);
        } catch (const std::exception&) {
          return fmt::format("expected {}, got '{}'", what, v);
        }
        return std::string();
      },
      zero_allowed ? "NUMBER >= 0" : "NUMBER > 0");
}

// A path option given as "" would be silently ignored (no --run-dir, no --ckpt): refused by the parser.
const CLI::Validator kNonEmpty(
    [](std::string& v) { return v.empty() ? std::string("an empty path; give a path or leave the option out") : std::string(); },
    "PATH");

struct Common {
  std::vector<std::string> configs;
  std::vector<std::string> plugins;
  std::vector<std::string> sets;
  std::string ckpt;
  std::string run_dir;
  bool profile = false;
  bool overwrite = false;
  bool allow_changed_plugins = false;
};

// What composes an experiment (compose_experiment): -c files, --set overrides, --plugin libraries.
// Returns -c, which the run commands make required.
CLI::Option* add_experiment_inputs(CLI::App* cmd, std::vector<std::string>& configs, std::vector<std::string>& sets,
                                   std::vector<std::string>& plugins) {
  auto* config = cmd->add_option("-c,--config", configs,
                                 "experiment YAML file; several (-c a.yaml -c b.yaml) compose in order: mappings merge, lists and "
                                 "values replace")
                     ->check(kNonEmpty);
  cmd->add_option("--set", sets, "override a key: --set trainer.max_steps=200 (repeatable)")->take_all();
  cmd->add_option("--plugin", plugins, "load a plugin (a component library built with strobe_add_plugin; repeatable)")
      ->take_all()
      ->check(kNonEmpty);
  return config;
}

void add_common(CLI::App* cmd, Common& c, bool evaluates) {
  add_experiment_inputs(cmd, c.configs, c.sets, c.plugins)->required();
  cmd->add_flag("--allow-changed-plugins", c.allow_changed_plugins,
                "go on when a plugin the checkpoint recorded has changed (said once and recorded in the run)");
  cmd->add_option("--ckpt", c.ckpt,
                  evaluates ? "checkpoint to evaluate (required unless model.init_from names the weights)"
                            : "checkpoint to resume from")
      ->check(kNonEmpty);
}

// Where the command is, for the out-of-memory advice (copies: the run is gone when the error lands).
struct Progress {
  bool built = false;
  std::string device, batch_size;
};

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// The texts of libtorch's CPU allocator ("DefaultCPUAllocator: can't allocate memory ... Error code
// 12", older "not enough memory") and of CUDA's caching allocator ("CUDA out of memory").
bool is_allocation_failure(const std::string& what) {
  for (const char* p : {"can't allocate memory", "not enough memory", "out of memory", "Cannot allocate memory"})
    if (what.find(p) != std::string::npos) return true;
  return false;
}

// Which limit ended a run that was not stopped by a NaN or a signal: the summary always says it.
std::string stop_reason(const strobe::TrainerView& t, int rc) {
  if (rc == strobe::kExitNaN || rc == strobe::kExitSigint || rc == strobe::kExitSigterm) return "";
  const auto& c = t.config();
  const auto& s = t.state();
  if (c.fast_dev_run > 0) return fmt::format("trainer.fast_dev_run: {} batch(es)", c.fast_dev_run);
  if (c.max_steps >= 0 && s.global_step >= c.max_steps) return fmt::format("trainer.max_steps: {} reached", c.max_steps);
  if (c.max_epochs >= 0 && s.epoch_done && s.epoch + 1 >= c.max_epochs)
    return fmt::format("trainer.max_epochs: {} reached", c.max_epochs);
  if (t.should_stop()) return "a callback stopped it (early_stopping, or a callback's request_stop)";
  if (c.max_time_s) return "trainer.max_time reached";
  return "";
}

// Final metrics, the best checkpoint of every monitoring model_checkpoint, last.ckpt, the run directory.
void print_fit_summary(const strobe::Run& run, int rc, double seconds) {
  auto& t = run.trainer->view();
  t.drain_metrics();
  const auto& s = t.state();
  std::string how = rc == strobe::kExitOk       ? "finished"
                    : rc == strobe::kExitNaN    ? "stopped by the NaN capture"
                    : rc == strobe::kExitSigint ? "stopped by SIGINT"
                    : rc == strobe::kExitSigterm ? "stopped by SIGTERM"
                                                 : fmt::format("stopped (exit {})", rc);
  const std::string why = stop_reason(t, rc);
  fmt::print("strobe fit: {} at step {}, epoch {} in {:.1f} s{}\n", how, s.global_step, s.epoch, seconds,
             why.empty() ? "" : fmt::format(" ({})", why));
  std::string metrics;
  for (const auto& kv : t.metrics()) metrics += fmt::format(" {}={:.6g}", kv.first, kv.second);
  if (!metrics.empty()) fmt::print("  final metrics:{}\n", metrics);
  for (const auto& cb : run.callbacks) {
    const auto best = cb->best_checkpoint(run.run_dir);
    if (!best || !std::filesystem::exists(best->path)) continue;
    if (best->monitor.empty())
      fmt::print("  latest checkpoint: {}\n", best->path);
    else
      fmt::print("  best checkpoint: {} ({}={:.6g})\n", best->path, best->monitor, best->score);
  }
  if (run.run_dir.empty()) {
    fmt::print("  no run directory (trainer.fast_dev_run writes no files)\n");
  } else {
    if (std::filesystem::exists(run.run_dir + "/checkpoints/last.ckpt"))
      fmt::print("  last checkpoint: {}/checkpoints/last.ckpt\n", run.run_dir);
    fmt::print("  run directory: {}\n", run.run_dir);
  }
  std::fflush(stdout);
}

strobe::PredictOptions predict_opts;  // strobe predict's own options (main's parser fills them)

int run_command(const std::string& command, const Common& c, Progress& progress) {
  // --plugin joins the experiment's plugins: (so the resolved config records it), relative to here.
  auto doc = strobe::compose_experiment(c.configs, c.sets, c.plugins);
  if (c.profile) {
    // --profile: trainer.profiler with its defaults, unless the config already sets it up.
    const YAML::Node root = doc.root().node();
    const YAML::Node t = root["trainer"];
    bool configured = false;
    if (t.IsDefined() && t.IsMap()) {
      const YAML::Node p = t["profiler"];
      configured = p.IsDefined() && p.IsMap();
    }
    if (!configured) doc.apply_override("trainer.profiler={}");
  }
  strobe::RunOptions opt;
  opt.stage = command == "fit"        ? strobe::Stage::Fit
              : command == "validate" ? strobe::Stage::Validate
              : command == "predict"  ? strobe::Stage::Predict
                                      : strobe::Stage::Test;
  if (command == "predict") {
    // The output is checked before any work (never an input: the config, the checkpoint, every file
    // the experiment names); one process (a prediction run has no ranks to merge).
    auto inputs = strobe::experiment_inputs(doc.root().node(), c.configs.front());
    for (size_t i = 1; i < c.configs.size(); ++i) inputs.push_back({"a config file", c.configs[i]});
    if (!c.ckpt.empty()) inputs.push_back({"the checkpoint being read", c.ckpt});
    strobe::check_predict_output(predict_opts, inputs);
    if (strobe::distributed::launch_env_from_process().world_size > 1)
      throw strobe::config::ConfigError(
          "strobe predict runs as one process: start it without torchrun or srun (it writes one file in dataset order)");
  }
  if (!c.run_dir.empty()) opt.run_dir = c.run_dir;
  if (!c.ckpt.empty()) opt.ckpt = c.ckpt;
  opt.create_run_dir = command == "fit";
  opt.overwrite = c.overwrite;
  opt.allow_changed_plugins = c.allow_changed_plugins;
  if (command != "fit" && c.ckpt.empty()) {
    // validate/test evaluate a checkpoint, or the pretrained weights of model.init_from as they are.
    const YAML::Node root = doc.root().node();
    const YAML::Node model = root["model"];
    const bool init_from = model.IsDefined() && model.IsMap() && model["init_from"].IsDefined() && !model["init_from"].IsNull();
    if (!init_from)
      throw strobe::config::ConfigError(fmt::format(
          "strobe {}: --ckpt is required (the checkpoint to evaluate), unless model.init_from names the weights", command));
  }
  auto run = strobe::build_run(doc, opt);
  progress.built = true;
  // What composing the config dropped (a component another name replaced), once the run is built and
  // a resume's checks have passed: a refused run is then its one-line error alone.
  if (command == "fit")
    run->trainer->set_start_notes(doc.notes());
  else if (run->trainer->view().is_global_zero())
    for (const auto& note : doc.notes()) fmt::print(stderr, "strobe: {}\n", note);
  progress.device = run->trainer->view().device().str();
  const YAML::Node bs = run->experiment.data.node()["batch_size"];
  progress.batch_size = bs.IsScalar() ? bs.Scalar() : "?";
  // Data parallel: console output is rank 0's (docs/DISTRIBUTED.md).
  const bool speaks = run->trainer->view().is_global_zero();
  if (command == "fit") {
    if (speaks)
      fmt::print("strobe fit: {} (device {}{})\n",
                 run->run_dir.empty() ? "fast_dev_run, no run directory" : "run directory " + run->run_dir,
                 run->trainer->view().device().str(),
                 run->trainer->view().world_size() > 1 ? fmt::format(", {} processes", run->trainer->view().world_size()) : "");
    std::fflush(stdout);
    const auto t0 = std::chrono::steady_clock::now();
    const int rc = run->trainer->fit(std::move(run->checkpoint));
    if (speaks) print_fit_summary(*run, rc, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return rc;
  }
  if (command == "predict") {
    const auto& task = run->experiment.task.node();
    std::string task_name = task["name"].IsDefined() && task["name"].IsScalar() ? task["name"].Scalar() : "";
    if (task_name.empty())
      if (const auto* model = dynamic_cast<const strobe::Model*>(&run->module->net())) task_name = model->default_task();
    const strobe::PredictKind kind = task_name == "classification"      ? strobe::PredictKind::kClassification
                                     : task_name == "language_modeling" ? strobe::PredictKind::kLanguageModel
                                                                        : strobe::PredictKind::kRaw;
    const bool sigmoid = task["loss"].IsDefined() && task["loss"].IsScalar() && task["loss"].Scalar() == "per_class_bce";
    strobe::PredictWriter writer(predict_opts, kind, sigmoid, run->datamodule->info().class_names);
    const std::string source = c.ckpt.empty() ? "weights of model.init_from " + run->experiment.init_from->path : "checkpoint " + c.ckpt;
    run->trainer->predict(std::move(run->checkpoint), predict_opts.split == "val" ? strobe::Stage::Validate : strobe::Stage::Predict,
                          &writer);
    if (writer.samples() == 0)
      throw strobe::PredictError(fmt::format("the {} split has no samples (nothing written to {})", predict_opts.split,
                                             predict_opts.output));
    const int64_t n = writer.finish();
    fmt::print("strobe predict: {} {} of the {} split ({}) written to {}\n", n, n == 1 ? "sample" : "samples",
               predict_opts.split, source, predict_opts.output);
    return 0;
  }
  int rc = command == "validate" ? run->trainer->validate(std::move(run->checkpoint))
                                 : run->trainer->test(std::move(run->checkpoint));
  run->trainer->view().drain_metrics();
  if (!speaks) return rc;
  if (c.ckpt.empty())
    fmt::print("strobe {}: weights of model.init_from {}\n", command, run->experiment.init_from->path);
  else
    fmt::print("strobe {}: checkpoint {} (step {}, epoch {})\n", command, c.ckpt, run->trainer->view().state().global_step,
               run->trainer->view().state().epoch);
  const std::string prefix = command == "validate" ? "val/" : "test/";
  for (const auto& kv : run->trainer->view().metrics())
    if (kv.first.rfind(prefix, 0) == 0) fmt::print("{:<24} {:.6f}\n", kv.first, kv.second);
  return rc;
}

struct BenchArgs {
  std::vector<std::string> suites;
  std::string json;
  bool overwrite = false;
  strobe::bench::SuiteOptions options;
};

struct ReplayArgs {
  std::string capture;
  std::string device;
  std::string report;
  bool allow_changed_plugins = false;
  bool diagnose = false;
  bool bisect = false;
  std::string quarantine;
  bool overwrite = false;
};

int run_replay(const ReplayArgs& a) {
  if (a.bisect && a.diagnose) throw strobe::config::ConfigError("--bisect and --diagnose: give one of them");
  if (!a.quarantine.empty() && !a.bisect)
    throw strobe::config::ConfigError("--write-quarantine: needs --bisect (it writes the samples the bisection names)");
  strobe::capture::ReplayOptions opt;
  opt.allow_changed_plugins = a.allow_changed_plugins;
  if (!a.device.empty()) {
    if (a.device != "cpu" && a.device.rfind("cuda", 0) != 0)
      throw strobe::config::ConfigError(fmt::format("--device: expected cpu, cuda or cuda:<index>, got '{}'", a.device));
    if (a.device.rfind("cuda", 0) == 0 && !torch::cuda::is_available())
      throw strobe::config::ConfigError(fmt::format("--device {}: no CUDA device is visible", a.device));
    opt.device = a.device;
  }
  // The outputs are checked before the replay (docs/CONFIG.md, "Outputs"): never a file of the capture,
  // never each other; another existing file only with --overwrite, unless it is this command's own
  // earlier report (or, for --write-quarantine, a quarantine file, which is added to).
  std::vector<strobe::checkpoint::CommandInput> inputs{{"the capture directory", a.capture}};
  try {
    inputs.push_back({"the capture directory", strobe::capture::resolve_capture_dir(a.capture)});
  } catch (const strobe::checkpoint::CheckpointError&) {
    // replay_capture below says what is wrong with it
  }
  if (!a.report.empty()) {
    strobe::checkpoint::OutputFile out{"--report", a.report, a.overwrite, inputs, {{"the --write-quarantine file", a.quarantine}}};
    out.is_own = [](const std::string& path) {
      return strobe::checkpoint::json_file_where(path, [](const nlohmann::json& j) { return strobe::capture::is_replay_report(j); });
    };
    out.own_kind = "an earlier replay report";
    strobe::checkpoint::check_output_file(out);
  }
  if (!a.quarantine.empty()) {
    strobe::checkpoint::OutputFile out{"--write-quarantine", a.quarantine, a.overwrite, inputs, {{"the --report file", a.report}}};
    out.is_own = [](const std::string& path) {
      return strobe::checkpoint::json_file_where(path, [](const nlohmann::json& j) { return strobe::is_quarantine(j); });
    };
    out.own_kind = "a Strobe quarantine file (to add to)";
    strobe::checkpoint::check_output_file(out);
  }
  nlohmann::json report;
  if (a.bisect) {
    strobe::capture::BisectOptions b;
    b.replay = opt;
    b.quarantine = a.quarantine;
    b.replace_quarantine = a.overwrite;
    report = strobe::capture::bisect_capture(a.capture, b);
    fmt::print("{}", strobe::capture::format_bisection(report));
  } else if (a.diagnose) {
    report = strobe::capture::diagnose_capture(a.capture, opt);
    fmt::print("{}", strobe::capture::format_diagnosis(report));
  } else {
    report = strobe::capture::replay_capture(a.capture, opt);
    fmt::print("{}", strobe::capture::format_replay_report(report));
  }
  if (!a.report.empty()) {
    report["strobe_replay_report"] = 1;  // what makes it this command's own earlier output
    strobe::checkpoint::write_output("--report", a.report,
                                     [&] { strobe::checkpoint::write_file_atomic(a.report, report.dump(2) + "\n"); });
    fmt::print("report written to {}\n", a.report);
  }
  return 0;
}

// The components an experiment can name, by kind, as `strobe list` and `strobe --help` show them.
// Read anew on each call: plugins loaded since add their names.
std::vector<std::pair<std::string, std::vector<std::string>>> component_lists() {
  return {
      {"models", strobe::model_registry().names()},
      {"tasks", strobe::task_registry().names()},
      {"data", strobe::data_registry().names()},
      {"callbacks", strobe::callback_registry().names()},
      {"metrics", strobe::metrics::metric_registry().names()}};
}

std::string components_text() {
  std::string out = "Components (strobe list KIND: one per line):\n";
  for (const auto& [kind, names] : component_lists()) out += fmt::format("  {:<10} {}\n", kind + ":", fmt::join(names, ", "));
  return out;
}

// An error message as one readable line (docs/CONFIG.md): control characters and bytes that are not
// UTF-8 escaped (config::escaped), and a message over 1,500 characters cut in the middle, saying how
// much (a 1 MB tensor name or a YAML value with a newline stays one line).
std::string one_line(std::string_view s) {
  std::string out = strobe::config::escaped(s);
  constexpr size_t kMax = 1500, kHead = 1000, kTail = 300;
  if (out.size() <= kMax) return out;
  auto boundary = [&](size_t pos) {  // never inside a UTF-8 sequence
    while (pos < out.size() && (static_cast<unsigned char>(out[pos]) & 0xc0) == 0x80) ++pos;
    return pos;
  };
  const size_t head = boundary(kHead), tail = boundary(out.size() - kTail);
  return out.substr(0, head) + fmt::format(" [... {} characters left out ...] ", tail - head) + out.substr(tail);
}

// strobe list [KIND]: every kind with its names, or KIND's names one per line (for scripts).
int run_list(const std::string& kind) {
  if (kind.empty()) {
    fmt::print("{}", components_text());
    return 0;
  }
  std::vector<std::string> kinds;
  for (const auto& [k, names] : component_lists()) {
    if (k == kind) {
      for (const auto& n : names) fmt::print("{}\n", n);
      return 0;
    }
    kinds.push_back(k);
  }
  std::string hint = strobe::config::closest_match(kind, kinds);
  fmt::print(stderr, "strobe list: unknown kind '{}'{} (known: {})\n", one_line(kind),
             hint.empty() ? "" : fmt::format("; did you mean '{}'?", hint), fmt::join(kinds, ", "));
  return 2;
}

// The command line: every command's options, filled by CLI11's parser.
struct Cli {
  CLI::App app{"Strobe: Lightning-style training in C++ on libtorch"};
  Common fit_c, val_c, test_c, pred_c;
  ReplayArgs replay_a;
  strobe::ExportOptions export_a;
  BenchArgs bench_a;
  std::string list_kind;
  std::vector<std::string> list_plugins;
  std::string hang_dir;
  std::string sync_dir, sync_uri;
  double sync_timeout_s = 30;
  strobe::LrFindOptions lr_find;
  strobe::bench::BatchSizeOptions batch_size;
};

// fit, validate, test and predict: the commands that build a run from a config.
void add_run_commands(Cli& cli) {
  CLI::App& app = cli.app;
  Common &fit_c = cli.fit_c, &val_c = cli.val_c, &test_c = cli.test_c, &pred_c = cli.pred_c;
  auto* fit = app.add_subcommand("fit", "train (and validate) a model; resumes with --ckpt");
  add_common(fit, fit_c, false);
  fit->add_option("--run-dir", fit_c.run_dir, "run directory (default <default_root_dir>/<name>/version_<n>)")
      ->check(kNonEmpty);
  fit->add_flag("--overwrite", fit_c.overwrite,
                "start over in a run directory that holds another run: first remove its config.yaml, metrics.csv, "
                "checkpoints, NaN captures and TensorBoard events");
  fit->add_flag("--profile", fit_c.profile,
                "write a Chrome/TensorBoard trace of steps 20-25 to <run_dir>/profiler (trainer.profiler)");
  auto* val = app.add_subcommand("validate", "run the validation set with a checkpoint");
  add_common(val, val_c, true);
  auto* tst = app.add_subcommand("test", "run the test set with a checkpoint");
  add_common(tst, test_c, true);
  auto* pred = app.add_subcommand("predict", "run a checkpoint over the test (or validation) set and write its predictions");
  add_common(pred, pred_c, true);
  pred->add_option("-o,--output", predict_opts.output, "X.csv (classification: one row per sample) or X.safetensors")
      ->required()
      ->check(kNonEmpty);
  pred->add_option("--split", predict_opts.split, "test (default) or val");
  pred->add_flag("--overwrite", predict_opts.overwrite, "replace the output file if it exists");
  pred->add_flag("--logits", predict_opts.logits,
                 "language models: also write every token's logits (fp32, tokens x vocabulary) beside token_loss");
  pred->add_option("--logits-limit-gib", predict_opts.logits_limit_gib,
                   "refuse --logits past this many GiB of logits (default 4)");
}

void add_replay_command(Cli& cli) {
  ReplayArgs& replay_a = cli.replay_a;
  auto* rep = cli.app.add_subcommand("replay", "re-run the failing step of a NaN capture and name the first non-finite operation");
  rep->add_option("capture", replay_a.capture, "capture directory: <run_dir>/nan (the latest capture) or nan/step_<N>")
      ->required()
      ->check(kNonEmpty);
  rep->add_option("--device", replay_a.device, "cpu | cuda | cuda:<i> (default: the device it was captured on)");
  rep->add_option("--report", replay_a.report, "also write the report as JSON to this file")->check(kNonEmpty);
  rep->add_flag("--allow-changed-plugins", replay_a.allow_changed_plugins,
                "go on when a plugin the capture recorded has changed (said once; the report notes it)");
  rep->add_flag("--diagnose", replay_a.diagnose,
                "re-run the step as captured (twice), in fp32, in float64 on the CPU and on the previous step's batch, "
                "and give one verdict: not reproducible, precision, data, loss or weights");
  rep->add_flag("--bisect", replay_a.bisect,
                "find a minimal set of the step's samples that keeps it non-finite (or spiking) and name each one's "
                "dataset index and source");
  rep->add_option("--write-quarantine", replay_a.quarantine,
                  "with --bisect: add those samples to this quarantine file (read by data.exclude)")
      ->check(kNonEmpty);
  rep->add_flag("--overwrite", replay_a.overwrite,
                "replace an existing --report (or --write-quarantine) file that is not an earlier one of this command's "
                "(a file of the capture never)");
}

void add_export_command(Cli& cli) {
  strobe::ExportOptions& export_a = cli.export_a;
  auto* exp = cli.app.add_subcommand("export", "write a checkpoint's model weights as a safetensors file");
  exp->add_option("checkpoint", export_a.checkpoint, "a Strobe checkpoint (last.ckpt, a top-k checkpoint)")
      ->required()
      ->check(kNonEmpty);
  exp->add_option("-o,--output", export_a.output, "the .safetensors file to write (--names hf: the directory)")->required()->check(kNonEmpty);
  exp->add_flag("--overwrite", export_a.overwrite, "replace the output file if it exists");
  exp->add_flag("--ema", export_a.ema, "write the ema callback's averaged weights instead of the trained ones");
  exp->add_flag("--swa", export_a.swa, "write the swa callback's averaged weights (BatchNorm statistics recomputed) instead of the trained ones")->excludes("--ema");
  exp->add_option("--names", export_a.names,
                  "the names to write: strobe (the model's own, default), timm, torchvision, or hf (a llama as a Hugging Face "
                  "directory: -o DIR gets config.json + model.safetensors; docs/MODELS.md)");
}

void add_bench_command(Cli& cli) {
  BenchArgs& bench_a = cli.bench_a;
  auto* bench = cli.app.add_subcommand(
      "bench", "time training steps and kernels: suites step, giou, attention, optimizer, metrics, nan_capture (default: all)");
  bench->add_option("suites", bench_a.suites, "suites to run (default: all)");
  bench->add_option("--json", bench_a.json, "also write the results as JSON to this file")->check(kNonEmpty);
  bench->add_flag("--overwrite", bench_a.overwrite,
                  "replace an existing --json file that is not an earlier strobe bench result (the config never)");
  bench->add_option("-c,--config", bench_a.options.config, "step suite: time this config instead of the seed workloads");
  bench->add_option("--workload", bench_a.options.workloads,
                    "step suite: only these seed workloads (vit_l16, face_detector_giou, resnet50, lm_pack, lm_pad_to_max, "
                    "lm_pad_to_longest; repeatable)")
      ->allow_extra_args(false);
  bench->add_option("--set", bench_a.options.sets, "step suite: override a key of every workload (repeatable)")
      ->take_all()
      ->allow_extra_args(false);
  bench->add_option("--memory-limit-gib", bench_a.options.memory_limit_gib,
                    "step suite: cap the run's GPU at this many GiB, as a GPU of that size would hold the run (an "
                    "allocation past it fails as out of memory)")
      ->check(number_above_zero(false));
  bench->add_option("--warmup", bench_a.options.warmup, "warm-up steps/calls (default: per suite; step: 30 on CUDA, 3 on CPU)")
      ->check(number_above_zero(true));
  bench->add_option("--steps", bench_a.options.steps, "timed steps/calls (default: per suite; step: 50 on CUDA, 10 on CPU)")
      ->check(number_above_zero(false));
}

void add_hang_command(Cli& cli) {
  auto* hang = cli.app.add_subcommand(
      "hang", "read the records of collectives a multi-process run wrote when it hung, and say which rank diverged first and where");
  hang->add_option("run_dir", cli.hang_dir, "the run directory (it holds collectives_rank<r>.json)")->required()->check(kNonEmpty);
}

void add_mlflow_sync_command(Cli& cli) {
  auto* sync = cli.app.add_subcommand(
      "mlflow-sync", "send what a run's MLflow logger could not (RUN_DIR/mlflow_unsent.jsonl) to the tracking server, then remove the file");
  sync->add_option("run_dir", cli.sync_dir, "the run directory")->required()->check(kNonEmpty);
  sync->add_option("--tracking-uri", cli.sync_uri, "another server than the one the file names (http(s)://host:port)")->check(kNonEmpty);
  sync->add_option("--timeout", cli.sync_timeout_s, "seconds one request may take (default 30)")->check(number_above_zero(false));
}

void add_tune_command(Cli& cli) {
  auto* tune = cli.app.add_subcommand("tune", "find a starting learning rate (tune lr) or the largest batch a GPU holds (tune batch-size)");
  tune->require_subcommand(1);
  auto& o = cli.lr_find;
  auto* lr = tune->add_subcommand(
      "lr", "the learning-rate range test: train a few steps with an exponentially growing lr and suggest one (lr_find.csv, lr_find.svg)");
  add_experiment_inputs(lr, o.configs, o.sets, o.plugins);  // without -c: refused by the command with one line
  lr->add_option("--min", o.min_lr, "the first learning rate (default 1e-8)");
  lr->add_option("--max", o.max_lr, "the last learning rate (default 1)");
  lr->add_option("--steps", o.steps, "optimizer steps of the sweep (default 100)");
  lr->add_option("--out", o.out, "the folder of lr_find.csv and lr_find.svg (default lr_find)")->check(kNonEmpty);
  lr->add_option("--apply", o.apply, "write a copy of the config with the suggestion as optimizer.lr")->check(kNonEmpty);
  lr->add_option("--from", o.from, "suggest and plot from an earlier lr_find.csv, without training")->check(kNonEmpty);
  lr->add_flag("--overwrite", o.overwrite, "replace existing output files");
  auto& b = cli.batch_size;
  auto* bs = tune->add_subcommand(
      "batch-size", "the largest data.batch_size that trains and validates a few steps on the GPU, each trial a fresh process");
  add_experiment_inputs(bs, b.configs, b.sets, b.plugins);
  bs->add_option("--mode", b.mode, "power (double until a batch fails) or binsearch (then bisect; default power)");
  bs->add_option("--start", b.start, "the first batch to try (default: the config's data.batch_size)")->check(number_above_zero(false));
  bs->add_option("--max", b.max, "the largest batch to try (default: the training set's length)")->check(number_above_zero(false));
  bs->add_option("--steps", b.steps, "training steps of each trial (default 3)")->check(number_above_zero(false));
  bs->add_option("--memory-limit-gib", b.memory_limit_gib, "cap the GPU at this many GiB, as a GPU of that size would hold the run")
      ->check(number_above_zero(false));
  bs->add_option("--apply", b.apply, "write a copy of the config with the answer as data.batch_size")->check(kNonEmpty);
  bs->add_flag("--overwrite", b.overwrite, "replace --apply's file if it exists");
  bs->add_option("--trial", b.trial, "(internal) run one trial of this batch")->group("");
}

void add_list_command(Cli& cli) {
  auto* list = cli.app.add_subcommand("list", "list the models, tasks, data modules, callbacks and metrics an experiment can name");
  list->add_option("kind", cli.list_kind, "models | tasks | data | callbacks | metrics: that kind's names, one per line");
  list->add_option("--plugin", cli.list_plugins, "load a plugin first: its components are listed too (repeatable)")
      ->take_all()
      ->check(kNonEmpty);
}

// Parses the command line; returns the exit status when the process ends here (help, version, a
// usage error: one line and 2), nullopt when a command is to run.
std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  // A mistyped command (`strobe fti -c x.yaml`): name it and the closest command, instead of
  // CLI11's list of every argument it did not expect.
  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> commands;
    for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; })) commands.push_back(sub->get_name());
    if (std::find(commands.begin(), commands.end(), argv[1]) == commands.end()) {
      const std::string hint = strobe::config::closest_match(argv[1], commands);
      fmt::print(stderr, "strobe: unknown command '{}'{} (commands: {}); run 'strobe --help' for usage\n", one_line(argv[1]),
                 hint.empty() ? "" : fmt::format("; did you mean '{}'?", hint), fmt::join(commands, ", "));
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ValidationError& e) {
    fmt::print(stderr, "strobe: {}\n", one_line(e.what()));  // names the option and says what to give: one line
    return 2;
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "strobe: {}; run 'strobe --help' for usage\n", one_line(e.what()));
    return 2;
  }
  if (app.get_subcommands().empty()) {
    fmt::print(stderr, "strobe: a command is required (fit, validate, test, predict, replay, export, bench, list, hang, tune, mlflow-sync); run 'strobe --help' for usage\n");
    return 2;
  }
  return std::nullopt;
}

// Out of memory: one line naming what to lower. Exit 1: the input was accepted, the run started and
// this machine could not hold it (a batch that cannot fit at all is refused at setup with exit 2).
int out_of_memory(const std::string& command, const Cli& cli, const Progress& progress, const std::string& what) {
  if (command == "bench") {
    const double cap = cli.bench_a.options.memory_limit_gib;
    fmt::print(stderr, "strobe bench: out of memory{} ({})\n",
               cap > 0 ? fmt::format(" under --memory-limit-gib {:g}", cap) : "", first_line(what));
  } else if (!progress.built) {
    fmt::print(stderr, "strobe: out of memory while building the model and data ({}); use a smaller model (model.*) or dataset\n",
               first_line(what));
  } else {
    fmt::print(stderr, "strobe: out of memory on {} ({}); lower data.batch_size (now {}), or keep the effective batch "
               "with trainer.accumulate_grad_batches, or use trainer.precision: bf16-mixed\n",
               progress.device, first_line(what), progress.batch_size);
  }
  return 1;
}

int run_parsed(const std::string& command, Cli& cli, Progress& progress) {
  if (command == "list") {
    strobe::load_plugins(cli.list_plugins);
    return run_list(cli.list_kind);
  }
  if (command == "replay") return run_replay(cli.replay_a);
  if (command == "tune" && cli.app.get_subcommand("tune")->got_subcommand("batch-size"))
    return strobe::bench::run_batch_size_finder(cli.batch_size);
  if (command == "tune") {
    if (cli.lr_find.from.empty() && cli.lr_find.configs.empty())
      throw strobe::LrFindError("-c/--config is required (the experiment to sweep), unless --from names an earlier lr_find.csv");
    return strobe::run_lr_find(cli.lr_find);
  }
  if (command == "hang") {
    fmt::print("{}", strobe::explain_hang(cli.hang_dir));
    return 0;
  }
  if (command == "mlflow-sync") {
    if (!cli.sync_uri.empty() && cli.sync_uri.rfind("http://", 0) != 0 && cli.sync_uri.rfind("https://", 0) != 0)
      throw strobe::logging::MlflowSyncInputError(fmt::format("--tracking-uri: '{}' is not an http:// or https:// address", cli.sync_uri));
    fmt::print("{}\n", strobe::logging::mlflow_sync(cli.sync_dir, cli.sync_uri, cli.sync_timeout_s));
    return 0;
  }
  if (command == "bench") return strobe::bench::run_bench(cli.bench_a.suites, cli.bench_a.json, cli.bench_a.options, cli.bench_a.overwrite);
  if (command == "export") {
    const int n = strobe::export_weights(cli.export_a);
    fmt::print("strobe export: {} tensors of {} written to {}{}\n", n, cli.export_a.checkpoint, cli.export_a.output,
               cli.export_a.names == "strobe" ? "" : fmt::format(" ({} names)", cli.export_a.names));
    return 0;
  }
  const Common& c = command == "fit" ? cli.fit_c : command == "validate" ? cli.val_c : command == "predict" ? cli.pred_c : cli.test_c;
  return run_command(command, c, progress);
}

// The exception a command ended with, as one line and its exit status (docs/CONFIG.md, "Exit codes").
int report_error(const std::string& command, const Cli& cli, const Progress& progress) {
  auto oom = [&](const std::string& what) { return out_of_memory(command, cli, progress, what); };
  try {
    throw;
  } catch (const strobe::PluginError& e) {
    fmt::print(stderr, "strobe: plugin error: {}\n", one_line(e.what()));
    return 2;
  } catch (const strobe::bench::BenchUsageError& e) {
    fmt::print(stderr, "strobe {}: {}\n", command == "tune" ? "tune batch-size" : "bench", one_line(e.what()));
    return 2;
  } catch (const strobe::ExportError& e) {
    fmt::print(stderr, "strobe export: {}\n", one_line(e.what()));
    return 2;
  } catch (const strobe::LrFindError& e) {
    fmt::print(stderr, "strobe tune lr: {}\n", one_line(e.what()));
    return 2;
  } catch (const strobe::HangError& e) {
    fmt::print(stderr, "strobe hang: {}\n", one_line(e.what()));
    return 2;
  } catch (const strobe::logging::MlflowSyncInputError& e) {
    fmt::print(stderr, "strobe mlflow-sync: {}\n", one_line(e.what()));
    return 2;
  } catch (const strobe::logging::MlflowError& e) {
    fmt::print(stderr, "strobe mlflow-sync: {}\n", one_line(e.what()));  // the server failed part-way: exit 1
    return 1;
  } catch (const strobe::PredictError& e) {
    fmt::print(stderr, "strobe predict: {}\n", one_line(e.what()));
    return 2;
  } catch (const strobe::checkpoint::OutputRefused& e) {
    fmt::print(stderr, "strobe {}: {}\n", command, one_line(e.what()));  // docs/CONFIG.md, "Outputs"
    return 2;
  } catch (const strobe::RunDirError& e) {
    fmt::print(stderr, "strobe: run directory error: {}\n", one_line(e.what()));
    return 2;
  } catch (const strobe::checkpoint::WriteError& e) {
    // The disk, a quota or the file-size limit: the run's input was fine, this machine could not hold
    // its output (the previous file is kept; docs/CONFIG.md).
    fmt::print(stderr, "strobe: write error: {}\n", one_line(e.what()));
    return 1;
  } catch (const c10::OutOfMemoryError& e) {
    return oom(e.what_without_backtrace());
  } catch (const std::bad_alloc& e) {
    return oom(e.what());
  } catch (const strobe::config::ConfigError& e) {
    fmt::print(stderr, "strobe: config error: {}\n", one_line(e.what()));
    return 2;
  } catch (const strobe::checkpoint::CheckpointError& e) {
    fmt::print(stderr, "strobe: checkpoint error: {}\n", one_line(e.what()));
    return 2;
  } catch (const strobe::data::DataError& e) {
    fmt::print(stderr, "strobe: data error: {}\n", one_line(e.what()));
    return 2;
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    // libtorch's CPU allocator reports a failed allocation as a plain c10::Error.
    if (is_allocation_failure(what)) return oom(what);
    fmt::print(stderr, "strobe: error: {}\n", one_line(what));
    return 1;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (is_allocation_failure(what)) return oom(what);
    fmt::print(stderr, "strobe: error: {}\n", one_line(what));
    return 1;
  } catch (...) {
    // A plugin's code outside a callback hook (call_hook wraps those) threw what is not a std::exception.
    fmt::print(stderr, "strobe: error: an exception that is not a std::exception (thrown by a plugin's code?)\n");
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // The command is named before the handlers exist, so that a signal arriving while the command line
  // is parsed already says which command it stopped.
  if (argc > 1) {
    const std::string first = argv[1];
    for (const char* name : {"validate", "test", "predict", "replay", "export", "bench", "list", "hang", "mlflow-sync"})
      if (first == name) strobe::signals::set_command(first);
  }
  strobe::signals::install();
  Cli cli;
  cli.app.require_subcommand(0, 1);
  cli.app.set_version_flag("--version", [] { return version_string(); });
  add_run_commands(cli);
  add_replay_command(cli);
  add_export_command(cli);
  add_bench_command(cli);
  add_list_command(cli);
  add_hang_command(cli);
  add_tune_command(cli);
  add_mlflow_sync_command(cli);
  cli.app.footer(components_text());
  if (const std::optional<int> rc = parse_command_line(cli.app, argc, argv)) return *rc;
  const std::string command = cli.app.get_subcommands().front()->get_name();
  if (command != "fit") strobe::signals::set_command(command);
  if (command == "fit" && strobe::signals::sigint_inherited_ignored())
    fmt::print(stderr, "strobe fit: SIGINT is ignored (inherited from the parent process); stop the run with SIGTERM\n");
  Progress progress;
  try {
    return run_parsed(command, cli, progress);
  } catch (...) {
    return report_error(command, cli, progress);
  }
}
