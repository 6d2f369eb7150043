#include "bench/lib/batch_size_finder.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <optional>

#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <yaml-cpp/yaml.h>

#include "bench/lib/bench.h"
#include "runner/experiment_builder.h"
#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/config.h"
#include "strobe/core/trainer.h"
#include "strobe/distributed/launch_env.h"

namespace strobe::bench {
namespace fs = std::filesystem;
namespace {

config::Document load(const BatchSizeOptions& o) { return compose_experiment(o.configs, o.sets, o.plugins); }

// One trial, in this process: `steps` training steps of batch `b` after 2 validation batches, no
// files; prints the training set's length first (the finder caps its search there). The estimate
// that refuses a batch before a run (trainer.memory_check) is off: the trial itself is the answer.
int trial(const BatchSizeOptions& o) {
  auto doc = load(o);
  for (const std::string& s :
       {fmt::format("data.batch_size={}", o.trial), fmt::format("trainer.max_steps={}", o.steps),
        std::string("trainer.num_sanity_val_steps=2"), std::string("trainer.limit_val_batches=2"),
        std::string("trainer.memory_check=false")})
    doc.apply_override(s);
  make_probe_run(doc);
  RunOptions ro;
  ro.create_run_dir = false;
  ro.on_device = [&](const torch::Device& d) {
    if (o.memory_limit_gib > 0) limit_device_memory(d, o.memory_limit_gib);
  };
  auto run = build_run(doc, ro);
  fmt::print("trial: training samples {}\n", run->datamodule->train_loader()->dataset().size());
  std::fflush(stdout);
  return run->trainer->fit();
}

std::string quoted(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

struct Outcome {
  bool fits = false;
  int64_t samples = -1;  // the training set's length, when the trial got that far
};

Outcome run_trial(const BatchSizeOptions& o, const std::string& self, int64_t b) {
  std::string cmd = quoted(self) + " tune batch-size --trial " + std::to_string(b) + " --steps " + std::to_string(o.steps);
  for (const auto& c : o.configs) cmd += " -c " + quoted(c);
  for (const auto& s : o.sets) cmd += " --set " + quoted(s);
  for (const auto& p : o.plugins) cmd += " --plugin " + quoted(p);
  if (o.memory_limit_gib > 0) cmd += fmt::format(" --memory-limit-gib {:.17g}", o.memory_limit_gib);
  cmd += " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) throw BenchUsageError("cannot start a trial process");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  Outcome r;
  if (auto at = out.find("trial: training samples "); at != std::string::npos) r.samples = std::stoll(out.substr(at + 24));
  if (rc == 0) {
    r.fits = true;
  } else if (out.find("out of memory") == std::string::npos) {
    // Not a question of memory: the config or the data is wrong, and every trial would say so.
    std::string last = out;
    while (!last.empty() && last.back() == '\n') last.pop_back();
    last = last.substr(last.rfind('\n') == std::string::npos ? 0 : last.rfind('\n') + 1);
    throw BenchUsageError(fmt::format("the trial of batch {} failed (exit {}), not for memory: {}", b, rc, last));
  }
  fmt::print("strobe tune batch-size: batch {}: {}\n", b, r.fits ? "trains" : "out of memory");
  std::fflush(stdout);
  return r;
}

}  // namespace

int run_batch_size_finder(const BatchSizeOptions& o) {
  if (o.trial > 0) return trial(o);
  if (o.configs.empty()) throw BenchUsageError("-c/--config is required");
  if (o.mode != "power" && o.mode != "binsearch")
    throw BenchUsageError(fmt::format("--mode {}: expected power or binsearch", o.mode));
  if (o.steps < 1) throw BenchUsageError(fmt::format("--steps {}: expected at least 1", o.steps));
  if (distributed::launch_env_from_process().world_size > 1)
    throw config::ConfigError("strobe tune batch-size runs as one process: start it without torchrun or srun");
  auto doc = load(o);
  const YAML::Node root = doc.root().node();
  const YAML::Node device = root["trainer"] && root["trainer"]["device"] ? root["trainer"]["device"] : YAML::Node();
  const std::string dev = device.IsScalar() ? device.Scalar() : "auto";
  if (dev == "cpu" || !torch::cuda::is_available())
    throw BenchUsageError(fmt::format(
        "it finds the largest batch a GPU holds, and this run trains on the CPU (trainer.device: {}{}): on a "
        "CPU the answer is the host's memory, which a smaller batch does not save",
        dev, torch::cuda::is_available() ? "" : "; no CUDA device"));
  const YAML::Node bs = root["data"] && root["data"]["batch_size"] ? root["data"]["batch_size"] : YAML::Node();
  int64_t b = o.start > 0 ? o.start : (bs.IsScalar() ? std::stoll(bs.Scalar()) : 32);
  char self_buf[4096];
  const ssize_t len = readlink("/proc/self/exe", self_buf, sizeof self_buf - 1);
  if (len <= 0) throw BenchUsageError("cannot find this program to start its trials");
  const std::string self(self_buf, static_cast<size_t>(len));

  Outcome first = run_trial(o, self, b);
  int64_t cap = o.max > 0 ? o.max : std::numeric_limits<int64_t>::max();
  if (first.samples > 0) cap = std::min(cap, first.samples);
  int64_t good = 0, bad = 0;
  if (first.fits) {
    good = b;
  } else {
    bad = b;
    // The start does not fit: halve until a batch does.
    while (!good && b > 1) {
      b /= 2;
      if (run_trial(o, self, b).fits) good = b; else bad = b;
    }
    if (!good) throw BenchUsageError("even a batch of 1 runs out of memory on this GPU");
  }
  std::string why;
  // Double while it fits (power), up to the cap.
  while (!bad) {
    if (good >= cap) {
      why = o.max > 0 && cap == o.max ? " (--max)" : " (the training set's length)";
      break;
    }
    const int64_t next = std::min(good * 2, cap);
    if (run_trial(o, self, next).fits) good = next; else bad = next;
  }
  if (o.mode == "binsearch")
    while (bad && bad - good > 1) {
      const int64_t mid = good + (bad - good) / 2;
      if (run_trial(o, self, mid).fits) good = mid; else bad = mid;
    }
  fmt::print("strobe tune batch-size: largest batch that trains: {}{}{}\n", good, why,
             bad ? fmt::format(" ({} runs out of memory{})", bad, o.mode == "power" ? "; --mode binsearch looks between" : "")
                 : "");
  if (!o.apply.empty()) {
    std::error_code ec;
    if (!o.overwrite && fs::exists(o.apply, ec))
      throw BenchUsageError(fmt::format("{} exists; give --overwrite to replace it", o.apply));
    doc.apply_override(fmt::format("data.batch_size={}", good));
    YAML::Emitter e;
    e << doc.root().node();
    checkpoint::write_file_atomic(o.apply, std::string("# written by strobe tune batch-size: data.batch_size is its answer\n") +
                                               e.c_str() + "\n");
    fmt::print("strobe tune batch-size: wrote {} (the config with data.batch_size: {})\n", o.apply, good);
  }
  return 0;
}

}  // namespace strobe::bench
