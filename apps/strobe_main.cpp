// strobe: the command line (CONFIG.md). Exit status: 0 success; 2 bad usage, config, checkpoint,
// capture or data argument (one message on stderr); 3 stopped by a NaN capture; 130/143 interrupted
// by SIGINT/SIGTERM after saving last.ckpt; 1 any other failure.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include "framework/checkpoint/checkpoint_io.h"
#include "framework/config/config.h"
#include "framework/core/capture.h"
#include "framework/core/experiment_builder.h"

namespace {

std::string version_string() {
  std::string cuda = torch::cuda::is_available() ? fmt::format("CUDA, {} device(s) visible", torch::cuda::device_count())
                                                 : "no CUDA device visible";
  return fmt::format("strobe {} (libtorch {}; {})", STROBE_VERSION, TORCH_VERSION, cuda);
}

struct Common {
  std::string config;
  std::vector<std::string> sets;
  std::string ckpt;
  std::string run_dir;
};

void add_common(CLI::App* cmd, Common& c, bool ckpt_required) {
  cmd->add_option("-c,--config", c.config, "experiment YAML file")->required();
  cmd->add_option("--set", c.sets, "override a key: --set trainer.max_steps=200 (repeatable)")->take_all();
  auto* ck = cmd->add_option("--ckpt", c.ckpt, ckpt_required ? "checkpoint to evaluate" : "checkpoint to resume from");
  if (ckpt_required) ck->required();
}

int run_command(const std::string& command, const Common& c) {
  auto doc = strobe::config::Document::load_file(c.config);
  for (const auto& s : c.sets) doc.apply_override(s);
  strobe::RunOptions opt;
  opt.stage = command == "fit" ? strobe::Stage::Fit : command == "validate" ? strobe::Stage::Validate : strobe::Stage::Test;
  if (!c.run_dir.empty()) opt.run_dir = c.run_dir;
  if (!c.ckpt.empty()) opt.ckpt = c.ckpt;
  opt.create_run_dir = command == "fit";
  if (!c.ckpt.empty()) {
    // Refuse a bad checkpoint before any work starts.
    strobe::checkpoint::load_checkpoint_file(c.ckpt);
  }
  auto run = strobe::build_run(doc, opt);
  std::optional<std::string> ckpt;
  if (!c.ckpt.empty()) ckpt = c.ckpt;
  if (command == "fit") {
    fmt::print("strobe fit: run directory {} (device {})\n", run->run_dir, run->trainer->device().str());
    std::fflush(stdout);
    return run->trainer->fit(ckpt);
  }
  int rc = command == "validate" ? run->trainer->validate(ckpt) : run->trainer->test(ckpt);
  run->trainer->drain_metrics();
  const std::string prefix = command == "validate" ? "val/" : "test/";
  for (const auto& kv : run->trainer->metrics())
    if (kv.first.rfind(prefix, 0) == 0) fmt::print("{:<24} {:.6f}\n", kv.first, kv.second);
  return rc;
}

struct ReplayArgs {
  std::string capture;
  std::string device;
  std::string report;
};

int run_replay(const ReplayArgs& a) {
  strobe::capture::ReplayOptions opt;
  if (!a.device.empty()) {
    if (a.device != "cpu" && a.device.rfind("cuda", 0) != 0)
      throw strobe::config::ConfigError(fmt::format("--device: expected cpu, cuda or cuda:<index>, got '{}'", a.device));
    if (a.device.rfind("cuda", 0) == 0 && !torch::cuda::is_available())
      throw strobe::config::ConfigError(fmt::format("--device {}: no CUDA device is visible", a.device));
    opt.device = a.device;
  }
  auto report = strobe::capture::replay_capture(a.capture, opt);
  fmt::print("{}", strobe::capture::format_replay_report(report));
  if (!a.report.empty()) {
    namespace fs = std::filesystem;
    const std::string tmp = a.report + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      if (!out) throw strobe::config::ConfigError(fmt::format("--report: cannot write '{}'", a.report));
      out << report.dump(2) << "\n";
    }
    fs::rename(tmp, a.report);
    fmt::print("report written to {}\n", a.report);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Strobe: Lightning-style training in C++ on libtorch"};
  app.require_subcommand(0, 1);
  app.set_version_flag("--version", [] { return version_string(); });
  Common fit_c, val_c, test_c;
  auto* fit = app.add_subcommand("fit", "train (and validate) a model; resumes with --ckpt");
  add_common(fit, fit_c, false);
  fit->add_option("--run-dir", fit_c.run_dir, "run directory (default <default_root_dir>/<name>/version_<n>)");
  auto* val = app.add_subcommand("validate", "run the validation set with a checkpoint");
  add_common(val, val_c, true);
  auto* tst = app.add_subcommand("test", "run the test set with a checkpoint");
  add_common(tst, test_c, true);
  ReplayArgs replay_a;
  auto* rep = app.add_subcommand("replay", "re-run the failing step of a NaN capture and name the first non-finite operation");
  rep->add_option("capture", replay_a.capture, "capture directory: <run_dir>/nan (the latest capture) or nan/step_<N>")->required();
  rep->add_option("--device", replay_a.device, "cpu | cuda | cuda:<i> (default: the device it was captured on)");
  rep->add_option("--report", replay_a.report, "also write the report as JSON to this file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "strobe: {}\nRun 'strobe --help' for usage.\n", e.what());
    return 2;
  }
  if (app.get_subcommands().empty()) {
    fmt::print(stderr, "strobe: a command is required (fit, validate, test, replay)\nRun 'strobe --help' for usage.\n");
    return 2;
  }
  const std::string command = app.get_subcommands().front()->get_name();
  const Common& c = command == "fit" ? fit_c : command == "validate" ? val_c : test_c;
  try {
    if (command == "replay") return run_replay(replay_a);
    return run_command(command, c);
  } catch (const strobe::config::ConfigError& e) {
    fmt::print(stderr, "strobe: config error: {}\n", e.what());
    return 2;
  } catch (const strobe::checkpoint::CheckpointError& e) {
    fmt::print(stderr, "strobe: checkpoint error: {}\n", e.what());
    return 2;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "strobe: error: {}\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "strobe: error: {}\n", e.what());
    return 1;
  }
}
