// The timing core and the `strobe bench` driver (suite dispatch, table, JSON).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <torch/torch.h>

#include "bench/lib/bench.h"
#include "runner/command_inputs.h"
#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/output_guard.h"

#ifdef STROBE_TORCH_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace strobe::bench {

namespace {
double percentile(const std::vector<double>& sorted, double q) {
  // Linear interpolation between closest ranks (numpy's default).
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}
}  // namespace

Stats summarize(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.n = static_cast<int64_t>(v.size());
  s.min = v.front();
  s.max = v.back();
  s.median = percentile(v, 0.5);
  s.p10 = percentile(v, 0.1);
  s.p90 = percentile(v, 0.9);
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  return s;
}

nlohmann::json to_json(const Stats& s) {
  return {{"n", s.n}, {"median", s.median}, {"min", s.min}, {"max", s.max},
          {"p10", s.p10}, {"p90", s.p90},   {"mean", s.mean}};
}

struct Marks::Impl {
  torch::Device device{torch::kCPU};
  std::vector<std::chrono::steady_clock::time_point> host;
#ifdef STROBE_TORCH_HAS_CUDA
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> events;
#endif
};

Marks::Marks(torch::Device device) : impl_(std::make_unique<Impl>()) { impl_->device = device; }
Marks::~Marks() = default;

void Marks::record() {
#ifdef STROBE_TORCH_HAS_CUDA
  if (impl_->device.is_cuda()) {
    impl_->events.push_back(std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));
    impl_->events.back()->record();
    return;
  }
#endif
  impl_->host.push_back(std::chrono::steady_clock::now());
}

size_t Marks::size() const {
#ifdef STROBE_TORCH_HAS_CUDA
  if (impl_->device.is_cuda()) return impl_->events.size();
#endif
  return impl_->host.size();
}

std::vector<double> Marks::intervals_ms() {
  std::vector<double> out;
#ifdef STROBE_TORCH_HAS_CUDA
  if (impl_->device.is_cuda()) {
    auto& e = impl_->events;
    if (!e.empty()) e.back()->synchronize();
    for (size_t i = 1; i < e.size(); ++i) out.push_back(e[i - 1]->elapsed_time(*e[i]));
    return out;
  }
#endif
  auto& h = impl_->host;
  for (size_t i = 1; i < h.size(); ++i) out.push_back(std::chrono::duration<double, std::milli>(h[i] - h[i - 1]).count());
  return out;
}

void synchronize(torch::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index() < 0 ? -1 : device.index());
}

std::vector<double> time_calls(const std::function<void()>& fn, int64_t warmup, int64_t reps, torch::Device device) {
  for (int64_t i = 0; i < warmup; ++i) fn();
  synchronize(device);
  std::vector<double> out;
  for (int64_t i = 0; i < reps; ++i) {
    Marks m(device);
    m.record();
    fn();
    m.record();
    out.push_back(m.intervals_ms().at(0));
  }
  return out;
}

std::vector<double> time_blocks(const std::function<void()>& fn, int64_t warmup, int64_t blocks, int64_t per_block,
                                torch::Device device) {
  for (int64_t i = 0; i < warmup; ++i) fn();
  synchronize(device);
  std::vector<double> out;
  for (int64_t b = 0; b < blocks; ++b) {
    Marks m(device);
    m.record();
    for (int64_t i = 0; i < per_block; ++i) fn();
    m.record();
    out.push_back(m.intervals_ms().at(0) / static_cast<double>(per_block));
  }
  return out;
}

void write_json_atomic(const std::string& path, const nlohmann::json& j) {
  checkpoint::write_output("--json", path, [&] { checkpoint::write_file_atomic(path, j.dump(2) + "\n"); });
}

void check_json_output(const std::string& path, bool overwrite, const std::string& config) {
  checkpoint::OutputFile out{"--json", path, overwrite};
  if (!config.empty()) {
    out.inputs.push_back({"the config file", config});
    // The files it names, read from a regular file only: a pipe (-c <(cmd)) is read once, by the suite.
    struct stat st {};
    if (::stat(config.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= (4 << 20)) {
      try {
        const auto more = experiment_inputs(YAML::LoadFile(config), "");
        out.inputs.insert(out.inputs.end(), more.begin(), more.end());
      } catch (const std::exception&) {
        // the step suite says what is wrong with the config
      }
    }
  }
  out.is_own = [](const std::string& p) {
    return checkpoint::json_file_where(p, [](const nlohmann::json& j) {
      return j.contains("strobe_version") && j.contains("suites") && j["suites"].is_object();
    });
  };
  out.own_kind = "an earlier strobe bench result";
  checkpoint::check_output_file(out);
}

namespace {
std::string suite_device_name(bool cuda) {
#ifdef STROBE_TORCH_HAS_CUDA
  if (cuda) return std::string("cuda: ") + at::cuda::getCurrentDeviceProperties()->name;
#endif
  (void)cuda;
  return "cpu";
}
}  // namespace

const std::vector<std::pair<std::string, SuiteFn>>& suites() {
  static const std::vector<std::pair<std::string, SuiteFn>> s = {
      {"step", step_suite},           {"giou", giou_suite},       {"attention", attention_suite},
      {"optimizer", optimizer_suite}, {"metrics", metrics_suite}, {"nan_capture", nan_capture_suite}};
  return s;
}

nlohmann::json skipped(const std::string& suite, const std::string& reason) {
  fmt::print(stderr, "strobe bench: {} skipped: {}\n", suite, reason);
  return {{"status", "skipped"}, {"reason", reason}, {"workloads", nlohmann::json::array()}};
}

std::string format_table(const nlohmann::json& result) {
  std::string out = fmt::format("{:<12} {:<34} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10}  {}\n", "suite", "workload", "n",
                                "median ms", "min", "p10", "p90", "max", "input-wait ms (median, p90) / note");
  for (const auto& [suite, r] : result.at("suites").items()) {
    if (r.value("status", "") != "ok") {
      out += fmt::format("{:<12} {}\n", suite, r.value("status", "?") + ": " + r.value("reason", ""));
      continue;
    }
    for (const auto& w : r.at("workloads")) {
      const auto& t = w.at("ms");
      std::string note = w.value("note", "");
      if (w.contains("input_wait_ms"))
        note = fmt::format("{:.3f}, {:.3f}", w["input_wait_ms"]["median"].get<double>(),
                           w["input_wait_ms"]["p90"].get<double>()) +
               (note.empty() ? "" : "; " + note);
      out += fmt::format("{:<12} {:<34} {:>6} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f}  {}\n", suite,
                         w.at("name").get<std::string>(), t.at("n").get<int64_t>(), t.at("median").get<double>(),
                         t.at("min").get<double>(), t.at("p10").get<double>(), t.at("p90").get<double>(),
                         t.at("max").get<double>(), note);
    }
  }
  return out;
}

int run_bench(const std::vector<std::string>& names, const std::string& json_path, const SuiteOptions& opt, bool overwrite) {
  std::vector<std::pair<std::string, SuiteFn>> chosen;
  for (const auto& n : names) {
    auto it = std::find_if(suites().begin(), suites().end(), [&](const auto& s) { return s.first == n; });
    if (it == suites().end()) {
      std::string known;
      for (const auto& s : suites()) known += (known.empty() ? "" : ", ") + s.first;
      throw BenchUsageError(fmt::format("unknown suite '{}' (suites: {})", n, known));
    }
    chosen.push_back(*it);
  }
  if (chosen.empty()) chosen = suites();
  if (!opt.config.empty() && !(chosen.size() == 1 && chosen[0].first == "step"))
    throw BenchUsageError("--config applies to the step suite only: strobe bench step --config FILE");
  if (!opt.workloads.empty() && std::none_of(chosen.begin(), chosen.end(), [](const auto& s) { return s.first == "step"; }))
    throw BenchUsageError("--workload applies to the step suite only: strobe bench step --workload NAME");
  if (opt.memory_limit_gib > 0 && !(chosen.size() == 1 && chosen[0].first == "step"))
    throw BenchUsageError("--memory-limit-gib applies to the step suite only: strobe bench step --memory-limit-gib GIB");
  SuiteOptions o = opt;
  o.cuda = torch::cuda::is_available();
  if (o.memory_limit_gib > 0 && !o.cuda)
    throw BenchUsageError("--memory-limit-gib caps a GPU's memory, and no CUDA device is visible");
  check_step_options(o);
  // An unwritable --json, or one that would replace a file that is not an earlier result, is refused
  // before minutes of benchmarking (docs/CONFIG.md, "Outputs").
  if (!json_path.empty()) check_json_output(json_path, overwrite, o.config);
  nlohmann::json result = {{"strobe_version", STROBE_VERSION},
                           {"libtorch", TORCH_VERSION},
                           {"device", suite_device_name(o.cuda)},
                           {"suites", nlohmann::json::object()}};
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  result["date"] = date;
  for (const auto& [name, fn] : chosen) {
    if (name != "step") fmt::print(stderr, "strobe bench: {} ...\n", name);  // step names each workload
    result["suites"][name] = fn(o);
    if (!json_path.empty()) write_json_atomic(json_path, result);  // partial results survive a later failure
  }
  fmt::print("{}", format_table(result));
  std::fflush(stdout);
  return 0;
}

void reset_peak_memory(const torch::Device& device) {
#ifdef STROBE_TORCH_HAS_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
#endif
  (void)device;
}

namespace {
// The caching allocator's peak of allocated (or reserved) bytes since reset_peak_memory.
double allocator_peak(const torch::Device& device, bool reserved) {
#ifdef STROBE_TORCH_HAS_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    const auto& stat = reserved ? stats.reserved_bytes : stats.allocated_bytes;
    return static_cast<double>(stat[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak);
  }
#endif
  (void)device, (void)reserved;
  return 0;
}
}  // namespace

double peak_memory_bytes(const torch::Device& device) { return allocator_peak(device, false); }
double peak_reserved_bytes(const torch::Device& device) { return allocator_peak(device, true); }

#ifdef STROBE_TORCH_HAS_CUDA
namespace {
// (free, total) bytes of a CUDA device, from the driver.
std::pair<size_t, size_t> device_free_total(const torch::Device& device) {
  c10::cuda::CUDAGuard guard(device.index() < 0 ? 0 : device.index());
  size_t free = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return {free, total};
}
}  // namespace
#endif

double device_used_bytes(const torch::Device& device) {
#ifdef STROBE_TORCH_HAS_CUDA
  if (device.is_cuda()) {
    const auto [free, total] = device_free_total(device);
    return static_cast<double>(total - free);
  }
#endif
  (void)device;
  return 0;
}

void limit_device_memory(const torch::Device& device, double gib) {
  if (!device.is_cuda())
    throw BenchUsageError(fmt::format("--memory-limit-gib caps a GPU's memory, and this run trains on {}", device.str()));
#ifdef STROBE_TORCH_HAS_CUDA
  const double total = static_cast<double>(device_free_total(device).second);
  const double limit = gib * double(1 << 30);
  if (limit > total)
    throw BenchUsageError(fmt::format("--memory-limit-gib {:g} is more than {} has ({:.2f} GiB)", gib, device.str(),
                                      total / double(1 << 30)));
  c10::cuda::CUDACachingAllocator::setMemoryFraction(limit / total, device.index() < 0 ? 0 : device.index());
#endif
}

}  // namespace strobe::bench
