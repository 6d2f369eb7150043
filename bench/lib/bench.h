// strobe::bench: the timing core shared by `strobe bench` and the standalone benchmark programs
// (bench/nan, bench/metrics, bench/ops). Method (docs/PERFORMANCE.md): warm-up first, then every
// step or call timed on the device timeline (CUDA events on the current stream; the host's steady
// clock on the CPU), reported as median and spread (min, p10, p90, max) over many samples.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

namespace strobe::bench {

// Bad usage of the benchmark (unknown suite, bad option, unwritable --json): exit 2, one line.
struct BenchUsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Stats {
  int64_t n = 0;
  double median = 0, min = 0, max = 0, p10 = 0, p90 = 0, mean = 0;
};
Stats summarize(std::vector<double> samples);
nlohmann::json to_json(const Stats& s);

// Timestamps on the device timeline: CUDA events recorded on the current stream of `device`, or
// the host's steady clock on the CPU. intervals_ms() waits for the last mark and returns the times
// between consecutive marks.
class Marks {
 public:
  explicit Marks(torch::Device device);
  ~Marks();
  void record();
  size_t size() const;
  std::vector<double> intervals_ms();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Calls fn() `warmup` times, then `reps` times with a mark before and after each call (so host
// launch overhead is included, as in bench/pytorch_baselines.py); milliseconds per call.
std::vector<double> time_calls(const std::function<void()>& fn, int64_t warmup, int64_t reps, torch::Device device);
// Per-call milliseconds of `blocks` blocks of `per_block` back-to-back calls (one mark pair per block).
std::vector<double> time_blocks(const std::function<void()>& fn, int64_t warmup, int64_t blocks, int64_t per_block,
                                torch::Device device);

void synchronize(torch::Device device);

// Writes `j` to `path` atomically (temp file beside it, rename); checkpoint::WriteError (exit 1)
// naming --json if it cannot, the temp file removed.
void write_json_atomic(const std::string& path, const nlohmann::json& j);
// The output guard for --json (strobe/checkpoint/output_guard.h): never the config `config` or a file
// it names; an existing file only with `overwrite` unless it is an earlier strobe bench result; a
// folder that takes the file. Throws checkpoint::OutputRefused (exit 2).
void check_json_output(const std::string& path, bool overwrite, const std::string& config);

// The CUDA caching allocator's peak of allocated bytes since reset_peak_memory (0 on the CPU). The
// device's name is strobe::device_name (strobe/core/throughput.h).
void reset_peak_memory(const torch::Device& device);
double peak_memory_bytes(const torch::Device& device);
// The caching allocator's peak of reserved bytes (what it took from the driver) since
// reset_peak_memory, and what the whole device has in use now (its total less its free memory:
// the allocator's reservation plus the CUDA context, NCCL's buffers and anything else outside the
// allocator); 0 on the CPU.
double peak_reserved_bytes(const torch::Device& device);
double device_used_bytes(const torch::Device& device);
// Caps the caching allocator of a CUDA `device` at `gib` GiB, as a GPU of that size would hold it:
// an allocation past the cap fails with CUDA's out-of-memory error. Throws BenchUsageError when the
// device is not CUDA or has less memory than the cap.
void limit_device_memory(const torch::Device& device, double gib);

// --- suites ---
struct SuiteOptions {
  std::string config;              // step: one config instead of the default workloads
  std::vector<std::string> workloads;  // step: only these of the default workloads (by name)
  std::vector<std::string> sets;   // step: --set overrides applied to every workload (after ours)
  int64_t warmup = -1, steps = -1; // -1: the suite's default (on CUDA / on the CPU)
  bool cuda = false;               // a CUDA device is visible
  double memory_limit_gib = 0;     // step: cap the run's GPU at this many GiB (0: its whole memory)
  std::string source_dir;          // where configs/ is looked up when not found from the cwd
};

// One suite's result: {"status": "ok" | "skipped", "reason"?, "workloads": [{"name", ...,
// "step_ms"|"ms": Stats, ...}]}. Throws BenchUsageError for bad options, other errors otherwise.
using SuiteFn = nlohmann::json (*)(const SuiteOptions&);
nlohmann::json step_suite(const SuiteOptions& o);
// Throws BenchUsageError for an unknown --workload or --workload with --config.
void check_step_options(const SuiteOptions& o);
nlohmann::json giou_suite(const SuiteOptions& o);
nlohmann::json attention_suite(const SuiteOptions& o);
nlohmann::json optimizer_suite(const SuiteOptions& o);
nlohmann::json metrics_suite(const SuiteOptions& o);
nlohmann::json nan_capture_suite(const SuiteOptions& o);

// The suites in their default order, by name.
const std::vector<std::pair<std::string, SuiteFn>>& suites();
// {"status": "skipped", "reason": ...} (with a message on stderr) for a CUDA-only suite on the CPU.
nlohmann::json skipped(const std::string& suite, const std::string& reason);

// `strobe bench`: runs the named suites (all when empty), prints one table, writes --json.
// Returns the exit status; throws BenchUsageError for bad usage before anything runs.
int run_bench(const std::vector<std::string>& names, const std::string& json_path, const SuiteOptions& o,
              bool overwrite = false);

// The table printed for a result document (one row per workload).
std::string format_table(const nlohmann::json& result);

}  // namespace strobe::bench

namespace strobe::bench {

// The metrics-overhead benchmark of issue 4 (bench/metrics): resnet18 with no metrics vs the five
// seed metrics (separate confusion matrices / shared through MetricCollection), interleaved rounds,
// host syncs per step counted with CUDA sync-debug mode "warn".
struct MetricsOverheadOptions {
  int64_t steps = 200, warmup = 20, rounds = 3, batch = 128, classes = 1000, log_every = 100;
  std::string device = "cuda", precision = "bf16-mixed";
};
// {"workload", "device", "steps_per_round", "rounds", "cpp": {mode: {"step_ms_median",
// "step_ms_rounds", "overhead_pct", "syncs_per_step"}}} for modes none, strobe_separate, strobe_shared.
nlohmann::json metrics_overhead(const MetricsOverheadOptions& o);

// The NaN-capture overhead benchmark of issue 9 (bench/nan): ResNet-50 through the trainer's step
// path without callbacks and with nan_capture, interleaved rounds of `steps` steps (CUDA only).
struct NanOverheadOptions {
  int64_t steps = 30, warmup = 15, rounds = 7, batch = 128;
};
// {"workload", "plain_step_ms", "nan_capture_step_ms", "plain_median_ms", "nan_capture_median_ms",
//  "overhead_pct", "nan_capture_syncs_in_block", "block_steps", ...}
nlohmann::json nan_overhead(const NanOverheadOptions& o);

}  // namespace strobe::bench
