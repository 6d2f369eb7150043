// strobe replay --diagnose (docs/NAN_CAPTURE.md, "Diagnose"): re-runs a captured step several ways
// and says why it failed. The runs:
//   as captured, twice     same device and precision: reproducible? (the recorded loss bits, and
//                          the two replays against each other)
//   without fp8            the capture's precision with trainer.fp8 off (when the capture used it)
//   fp32                   autocast off, bf16-master weights from their fp32 masters (when the
//                          capture used another precision), trainer.fp8 off
//   float64 (CPU)          model and batches in float64, forward and backward only (models up to
//                          kFloat64MaxParams parameters)
//   previous step's batch  the captured weights on the batch before (re-read through the loader)
// "Bad" is non-finite for a NaN capture, over the recorded threshold for a spike. The verdict, in
// this order: not reproducible, weights (non-finite state), precision (fp8: only the float8 runs
// are bad; otherwise fp32 or float64 is good), loss, data, weights (the previous batch is bad too),
// undetermined.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <limits>
#include <optional>

#include <fmt/format.h>
#include <torch/torch.h>

#include "runner/replay.h"
#include "strobe/core/quarantine.h"
#include "strobe/config/config.h"
#include "strobe/core/capture.h"
#include "runner/spike_thresholds.h"

namespace strobe::capture {

namespace {

bool bad(const StepOutcome& o, bool spike, const SpikeThresholds& t) {
  if (!o.finite()) return true;
  if (!spike) return false;
  return (std::isfinite(t.loss) && o.mean_loss() > t.loss) || (std::isfinite(t.grad_norm) && o.grad_norm > t.grad_norm);
}

double dtype_max(const std::string& dtype) {
  if (dtype == "Half") return 65504.0;
  if (dtype == "BFloat16") return 3.3895313892515355e38;
  if (dtype == "Float") return static_cast<double>(std::numeric_limits<float>::max());
  return std::numeric_limits<double>::max();
}

nlohmann::json run_json(const std::string& name, const StepOutcome& o, bool is_bad) {
  nlohmann::json losses = nlohmann::json::array();
  for (const auto& l : o.losses) losses.push_back(fmt::format("{:.9g}", l.to(torch::kDouble).item<double>()));
  return {{"run", name},
          {"device", o.device},
          {"losses", losses},
          {"loss", std::isfinite(o.mean_loss()) ? nlohmann::json(o.mean_loss()) : nlohmann::json(fmt::format("{}", o.mean_loss()))},
          {"grad_norm", std::isfinite(o.grad_norm) ? nlohmann::json(o.grad_norm) : nlohmann::json(nullptr)},
          {"finite", o.finite()},
          {"bad", is_bad},
          {"nonfinite_grads", o.nonfinite_grads.size()},
          {"first_nonfinite", o.first ? o.first->to_json() : nlohmann::json(nullptr)},
          {"notes", o.notes}};
}

std::string where(const NonFiniteEvent& e) { return fmt::format("{} in {} ({})", e.op, e.module, e.phase); }

// The non-finite tensors a capture holds (weights, buffers, optimizer state, averages), worst first.
std::vector<std::string> nonfinite_state(const checkpoint::CheckpointData& d) {
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& [name, t] : d.tensors) {
    if (name.rfind("capture/", 0) == 0 || name.rfind("step/", 0) == 0 || name.rfind("logger/", 0) == 0 ||
        !at::isFloatingType(t.scalar_type()))
      continue;
    const int64_t n = torch::isfinite(t).logical_not().sum().item<int64_t>();
    if (n > 0) found.emplace_back(n, name);
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  std::vector<std::string> out;
  for (const auto& [n, name] : found) out.push_back(fmt::format("{} ({} non-finite)", name, n));
  return out;
}

// The largest parameters by max |w| (for the weights verdict when nothing is non-finite).
std::vector<std::string> largest_params(const checkpoint::CheckpointData& d, size_t k) {
  std::vector<std::pair<double, std::string>> all;
  for (const auto& [name, t] : d.tensors)
    if (name.rfind("model/", 0) == 0 && at::isFloatingType(t.scalar_type()) && t.numel() > 0)
      all.emplace_back(t.abs().max().to(torch::kDouble).item<double>(), name.substr(6));
  std::sort(all.rbegin(), all.rend());
  std::vector<std::string> out;
  for (size_t i = 0; i < all.size() && i < k; ++i) out.push_back(fmt::format("{} (max |w| {:.4g})", all[i].second, all[i].first));
  return out;
}

// The step replayed every way diagnose compares: as captured twice, in fp32, in float64 on the CPU
// and on the previous step's batch (each run that could be made).
struct DiagnosisRuns {
  StepOutcome a, b;  // as captured, twice
  std::optional<StepOutcome> no_fp8, fp32, f64, prev;
  bool matches_record = true, replays_agree = true;  // a's losses are the recorded bits; a and b agree
  nlohmann::json runs = nlohmann::json::array(), notes = nlohmann::json::array();
};

DiagnosisRuns replay_every_way(const LoadedCapture& cap, const ReplayOptions& options, bool spike, const SpikeThresholds& thr) {
  DiagnosisRuns d;
  const auto& info = cap.info;
  const std::string precision = info.value("precision", "32");
  ReplayVariant base;
  base.device = default_replay_device(cap, options);
  base.allow_changed_plugins = options.allow_changed_plugins;
  auto& runs = d.runs;
  auto& notes = d.notes;
  if (base.device != cap.captured_device)
    notes.push_back(fmt::format("captured on {}, replayed on {}: bits may differ across devices", cap.captured_device, base.device));

  // 1. As captured, twice.
  d.a = replay_step(cap, base);
  d.b = replay_step(cap, base);
  const StepOutcome &a = d.a, &b = d.b;
  runs.push_back(run_json("as captured (1)", a, bad(a, spike, thr)));
  runs.push_back(run_json("as captured (2)", b, bad(b, spike, thr)));
  const auto recorded = info.value("losses", nlohmann::json::array());
  d.matches_record = a.losses.size() == recorded.size(), d.replays_agree = a.losses.size() == b.losses.size();
  for (size_t i = 0; i < a.losses.size(); ++i) {
    if (i >= recorded.size() || recorded[i].value("bits", "") != tensor_bits(a.losses[i])) d.matches_record = false;
    if (i < b.losses.size() && tensor_bits(a.losses[i]) != tensor_bits(b.losses[i])) d.replays_agree = false;
  }

  // 2. without fp8 (when used), fp32, 3. float64, 4. the previous step's batch.
  if (cap.fp8) {
    ReplayVariant v = base;
    v.fp8_off = true;
    d.no_fp8 = replay_step(cap, v);
    runs.push_back(run_json(precision + " without fp8", *d.no_fp8, bad(*d.no_fp8, spike, thr)));
  }
  if (precision != "32") {
    ReplayVariant v = base;
    v.precision = "32";
    d.fp32 = replay_step(cap, v);
    runs.push_back(run_json("fp32", *d.fp32, bad(*d.fp32, spike, thr)));
  }
  int64_t params = 0;
  for (const auto& [name, t] : cap.data.tensors)
    if (name.rfind("model/", 0) == 0) params += t.numel();
  if (params <= kFloat64MaxParams) {
    ReplayVariant v = base;
    v.float64 = true;
    try {
      d.f64 = replay_step(cap, v);
      runs.push_back(run_json("float64 (CPU)", *d.f64, bad(*d.f64, spike, thr)));
    } catch (const std::exception& e) {
      notes.push_back(fmt::format("the float64 run failed: {}", e.what()));
    }
  } else {
    notes.push_back(fmt::format("the float64 run is skipped: the model holds {} parameters, above the cap of {}", params,
                                kFloat64MaxParams));
  }
  {
    ReplayVariant v = base;
    v.previous_step = true;
    try {
      d.prev = replay_step(cap, v);
      runs.push_back(run_json("previous step's batch", *d.prev, bad(*d.prev, spike, thr)));
    } catch (const std::exception& e) {
      notes.push_back(fmt::format("the previous step's batch was not replayed: {}", e.what()));
    }
  }

  return d;
}

// Non-finite rows of the batch itself, else of the first non-finite op's output when its leading
// dimension is the batch's: (micro-batch, row) pairs, and how they were found.
std::pair<std::vector<std::pair<size_t, int64_t>>, std::string> nonfinite_rows(const LoadedCapture& cap, const StepOutcome& a) {
  std::vector<std::pair<size_t, int64_t>> bad_rows;  // (micro-batch, row)
  std::string how;
  for (size_t m = 0; m < cap.batches.size(); ++m)
    for (const auto& [k, t] : cap.batches[m].tensors) {
      if (!at::isFloatingType(t.scalar_type()) || t.dim() < 1) continue;
      auto r = torch::isfinite(t).logical_not().reshape({t.size(0), -1}).any(1).nonzero().reshape({-1});
      for (int64_t i = 0; i < r.numel(); ++i) bad_rows.emplace_back(m, r[i].item<int64_t>()), how = fmt::format("the batch's '{}' holds non-finite values", k);
    }
  const int64_t batch_rows = cap.batches.empty() ? 0 : cap.batches[0].batch_size();
  if (bad_rows.empty() && a.first && a.first->output_rows == batch_rows && cap.batches.size() == 1 &&
      a.first->nonfinite_rows.size() < static_cast<size_t>(batch_rows)) {
    for (int64_t r : a.first->nonfinite_rows) bad_rows.emplace_back(0, r);
    how = fmt::format("the first non-finite op, {}, is non-finite only in these rows of the batch", where(*a.first));
  }
  return {bad_rows, how};
}

}  // namespace

nlohmann::json diagnose_capture(const std::string& path, const ReplayOptions& options) {
  const auto cap = load_capture(path);
  const auto& info = cap.info;
  const bool spike = info.value("kind", "") == "spike";
  const auto thr = spike_thresholds(info);
  const std::string precision = info.value("precision", "32");
  const DiagnosisRuns d = replay_every_way(cap, options, spike, thr);
  const StepOutcome& a = d.a;
  const std::optional<StepOutcome>&no_fp8 = d.no_fp8, &fp32 = d.fp32, &f64 = d.f64, &prev = d.prev;
  const bool matches_record = d.matches_record, replays_agree = d.replays_agree;
  nlohmann::json evidence = nlohmann::json::array();

  // The verdict.
  std::string verdict;
  nlohmann::json rows = nlohmann::json::array();
  const auto state = nonfinite_state(cap.data);
  const bool a_bad = bad(a, spike, thr);
  if (!matches_record || !replays_agree) {
    verdict = "not reproducible";
    if (!matches_record) evidence.push_back("the replayed loss is not the recorded one (other bits)");
    if (!replays_agree) evidence.push_back("two replays of the same step differ");
    const bool deterministic = cap.config->leaf("trainer.deterministic") == "true";
    evidence.push_back(deterministic ? "the run used trainer.deterministic: true, so the same inputs should give the same bits: "
                                       "this points at the hardware (run it again on another GPU)"
                                     : "the run did not use trainer.deterministic: true: non-deterministic kernels and a hardware "
                                       "fault cannot be told apart (capture again with it on)");
  } else if (!state.empty()) {
    verdict = "weights";
    evidence.push_back("the captured weights or optimizer state already hold non-finite values (worst first):");
    for (size_t i = 0; i < state.size() && i < 10; ++i) evidence.push_back("  " + state[i]);
  } else if (!a_bad) {
    verdict = "undetermined";
    evidence.push_back(spike ? "the replayed step does not exceed the recorded threshold" : "the replayed step stayed finite");
  } else if (no_fp8 && !bad(*no_fp8, spike, thr)) {
    verdict = "precision (fp8)";
    evidence.push_back(fmt::format("the step is {} with trainer.fp8's float8 GEMMs and not in {} without them",
                                   spike ? "a spike" : "non-finite", precision));
    if (a.first) evidence.push_back(fmt::format("first non-finite value with float8: {}", where(*a.first)));
  } else if ((fp32 && !bad(*fp32, spike, thr)) || (precision == "32" && f64 && !bad(*f64, spike, thr))) {
    verdict = "precision";
    const std::string higher = fp32 && !bad(*fp32, spike, thr) ? "fp32" : "float64";
    evidence.push_back(fmt::format("the step is {} in {} and not in {}", spike ? "a spike" : "non-finite", precision == "32" ? "fp32" : precision, higher));
    if (a.first) {
      const auto& o = a.first->output;
      double in_max = 0;
      for (const auto& s : a.first->inputs) in_max = std::max({in_max, std::abs(s.min), std::abs(s.max)});
      evidence.push_back(fmt::format("first op to overflow: {}: its output ({}) crossed the {} limit {:.6g} (+inf {}, -inf {}, nan {}); "
                                     "its largest finite input |x| {:.6g}",
                                     where(*a.first), o.dtype, o.dtype, dtype_max(o.dtype), o.pos_inf, o.neg_inf, o.nan, in_max));
    }
  } else if (!spike && a.first && a.first->module == "task.loss" && a.first->inputs_finite && a.first->phase == "forward") {
    verdict = "loss";
    evidence.push_back(fmt::format("the model's outputs are finite; the loss arithmetic makes the first non-finite value: {}", where(*a.first)));
    for (const auto& s : a.first->inputs)
      evidence.push_back(fmt::format("  {} shape {}: min {:.6g} max {:.6g}", s.name, nlohmann::json(s.shape).dump(), s.min, s.max));
  } else {
    const auto [bad_rows, how] = nonfinite_rows(cap, a);
    const bool every_precision = (!fp32 || bad(*fp32, spike, thr)) && (!f64 || bad(*f64, spike, thr));
    if (!bad_rows.empty() && every_precision) {
      verdict = "data";
      evidence.push_back(fmt::format("{} in every precision; {}", spike ? "a spike" : "non-finite", how));
      for (const auto& [m, r] : bad_rows) {
        const auto& idx = cap.batches[m].indices;
        nlohmann::json row = {{"micro_batch", m}, {"row", r}};
        if (r < static_cast<int64_t>(idx.size())) {
          const int64_t di = idx[static_cast<size_t>(r)];
          row["dataset_index"] = di;
          auto it = a.sources.find(di);
          if (it != a.sources.end() && !it->second.empty()) row["source"] = it->second;
        }
        rows.push_back(row);
      }
    } else if (prev && bad(*prev, spike, thr)) {
      verdict = "weights";
      evidence.push_back(fmt::format("the previous step's batch is {} with the same weights too: the weights, not this batch, are at fault",
                                     spike ? "over the threshold" : "non-finite"));
      evidence.push_back("largest parameters:");
      for (const auto& p : largest_params(cap.data, 5)) evidence.push_back("  " + p);
    } else if (every_precision && prev) {
      verdict = "data";
      evidence.push_back(fmt::format("{} in every precision, while the previous step's batch with the same weights is not: this batch "
                                     "is at fault{}",
                                     spike ? "a spike" : "non-finite",
                                     a.first ? fmt::format(" (first non-finite op {}, not traceable to single rows)", where(*a.first)) : ""));
    } else {
      verdict = "undetermined";
      evidence.push_back("no single cause fits the runs below");
    }
  }
  if (a.first && verdict.rfind("precision", 0) != 0 && verdict != "loss")
    evidence.push_back(fmt::format("first non-finite value as captured: {}", where(*a.first)));

  return {{"capture", cap.dir},
          {"step", info.value("step", int64_t{-1})},
          {"kind", spike ? "spike" : "nonfinite"},
          {"precision", precision},
          {"fp8", no_fp8.has_value()},
          {"verdict", verdict},
          {"evidence", evidence},
          {"rows", rows},
          {"runs", d.runs},
          {"float64_max_params", kFloat64MaxParams},
          {"notes", d.notes}};
}

std::string format_diagnosis(const nlohmann::json& r) {
  std::string out = fmt::format("Diagnosis of {} (step {}, {}, precision {}{})\n", r["capture"].get<std::string>(), r["step"].get<int64_t>(),
                                r["kind"].get<std::string>() == "spike" ? "loss spike" : "non-finite step", r["precision"].get<std::string>(),
                                r.value("fp8", false) ? " with trainer.fp8" : "");
  for (const auto& run : r["runs"]) {
    const auto& f = run["first_nonfinite"];
    out += fmt::format("  {:<24} {:<6} loss {:<14} {}{}\n", run["run"].get<std::string>(), run["device"].get<std::string>(),
                       run["loss"].is_number() ? fmt::format("{:.6g}", run["loss"].get<double>()) : run["loss"].get<std::string>(),
                       run["bad"].get<bool>() ? "BAD" : "ok",
                       f.is_null() ? "" : fmt::format("  first non-finite: {} in {} ({})", f["op"].get<std::string>(),
                                                      f["module"].get<std::string>(), f["phase"].get<std::string>()));
  }
  out += fmt::format("  verdict: {}\n", r["verdict"].get<std::string>());
  for (const auto& e : r["evidence"]) out += fmt::format("    {}\n", e.get<std::string>());
  for (const auto& row : r["rows"])
    out += fmt::format("    row {} of micro-batch {}{}{}\n", row["row"].get<int64_t>(), row["micro_batch"].get<int64_t>(),
                       row.contains("dataset_index") ? fmt::format(": dataset index {}", row["dataset_index"].get<int64_t>()) : "",
                       row.contains("source") ? fmt::format(" ({})", row["source"].get<std::string>()) : "");
  for (const auto& n : r["notes"]) out += fmt::format("  note: {}\n", n.get<std::string>());
  return out;
}

}  // namespace strobe::capture

// ---- strobe replay --bisect ----

namespace strobe::capture {

bool is_replay_report(const nlohmann::json& j) {
  const auto it = j.find("strobe_replay_report");
  return j.is_object() && it != j.end() && it->is_number_integer() && it->get<int64_t>() == 1;
}

nlohmann::json write_quarantine(const std::string& path, const nlohmann::json& samples, const std::string& capture_dir,
                                bool replace_other) {
  // Read, add, write under an exclusive lock on the file, so that bisections writing one quarantine
  // at once each add their samples (the write replaces the file: a waiter that locked the replaced
  // one opens the path again).
  int fd = -1;
  bool created = false;
  for (int attempt = 0;; ++attempt) {
    struct stat before {};
    const bool existed = ::stat(path.c_str(), &before) == 0;
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
    if (fd < 0)
      throw config::ConfigError(fmt::format("--write-quarantine: cannot open '{}' ({})", path, std::strerror(errno)));
    created = !existed;
    ::flock(fd, LOCK_EX);
    struct stat held {}, now {};
    if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &now) == 0 && held.st_ino == now.st_ino && held.st_dev == now.st_dev) break;
    ::close(fd);
    if (attempt > 1000) throw config::ConfigError(fmt::format("--write-quarantine: '{}' keeps being replaced", path));
  }
  struct Unlock {
    int fd;
    ~Unlock() { ::close(fd); }
  } unlock{fd};
  nlohmann::json q = {{"strobe_quarantine", 1}, {"samples", nlohmann::json::array()}};
  struct stat st {};
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    try {
      q = read_quarantine(path).json;
    } catch (const QuarantineError& e) {
      if (!replace_other)
        throw config::ConfigError(fmt::format("--write-quarantine: {}; name a new file or an earlier quarantine to add to "
                                              "(or pass --overwrite to replace it)",
                                              e.what()));
    }
  }
  std::set<std::pair<std::string, int64_t>> have;
  for (const auto& s : q["samples"]) have.emplace(s.value("split", ""), s.value("index", int64_t{-1}));
  int64_t added = 0;
  for (const auto& s : samples) {
    const std::pair<std::string, int64_t> key{s["split"].get<std::string>(), s["dataset_index"].get<int64_t>()};
    if (!have.insert(key).second) continue;
    nlohmann::json e = {{"split", key.first}, {"index", key.second}, {"capture", capture_dir}};
    if (s.contains("source")) e["source"] = s["source"];
    q["samples"].push_back(e);
    ++added;
  }
  try {
    checkpoint::write_file_atomic(path, q.dump(2) + "\n");
  } catch (const checkpoint::CheckpointError& e) {
    if (created && st.st_size == 0) ::unlink(path.c_str());  // the empty file this call created to lock
    throw config::ConfigError(fmt::format("--write-quarantine: cannot write '{}': {}", path, e.what()));
  }
  return {{"path", path}, {"added", added}, {"total", q["samples"].size()}};
}

namespace {

// The rows `rows` of a batch: every tensor whose leading dimension is the batch's, and the indices.
Batch take_rows(const Batch& b, const std::vector<int64_t>& rows) {
  const int64_t n = b.batch_size();
  Batch out;
  out.meta = b.meta;
  auto sel = torch::tensor(rows, torch::kLong);
  for (const auto& [k, t] : b.tensors) out.tensors[k] = t.dim() >= 1 && t.size(0) == n ? t.index_select(0, sel.to(t.device())) : t;
  for (int64_t r : rows)
    if (r < static_cast<int64_t>(b.indices.size())) out.indices.push_back(b.indices[static_cast<size_t>(r)]);
  out.meta["batch_size"] = static_cast<int64_t>(rows.size());
  return out;
}

using Row = std::pair<size_t, int64_t>;  // (micro-batch, row)
using Unit = std::tuple<size_t, size_t, int64_t>;  // (rank, micro-batch, row)

// `pair_singles`: a micro-batch left with one row runs it as two copies of itself (BatchNorm in
// training needs two values per channel; the copies give that row's own statistics).
std::vector<Batch> subset(const std::vector<Batch>& batches, const std::vector<Row>& units, bool pair_singles) {
  std::vector<std::vector<int64_t>> rows(batches.size());
  for (const auto& [m, r] : units) rows[m].push_back(r);
  if (pair_singles)
    for (auto& r : rows)
      if (r.size() == 1) r.push_back(r.front());
  std::vector<Batch> out;
  for (size_t m = 0; m < batches.size(); ++m)
    if (!rows[m].empty()) out.push_back(take_rows(batches[m], rows[m]));
  return out;
}

}  // namespace

namespace {

// Data parallel: every rank's part of the capture (one process: the capture itself), each row
// carrying its dataset index, which the bisection names.
std::vector<LoadedCapture> bisection_captures(const LoadedCapture& given) {
  std::vector<LoadedCapture> caps = rank_captures(given);
  if (caps.empty()) caps.push_back(given);
  for (const auto& cap : caps)
    for (size_t m = 0; m < cap.batches.size(); ++m)
      if (static_cast<int64_t>(cap.batches[m].indices.size()) != cap.batches[m].batch_size())
        throw checkpoint::CheckpointError(fmt::format(
            "{}: --bisect needs the dataset index of every row, and micro-batch {} carries {} for {} rows (a capture of an "
            "older build, or of batches made by hand)",
            cap.file, m, cap.batches[m].indices.size(), cap.batches[m].batch_size()));
  return caps;
}

// Delta debugging (ddmin) on a removal set: shrinks `c` while a part of it, or the rest without a
// part, still `fixes` the step; 1-minimal where every trial could run.
template <typename Fixes>
std::vector<Unit> ddmin(std::vector<Unit> c, Fixes fixes) {
  size_t n = 2;
  while (c.size() >= 2) {
    const size_t chunk = (c.size() + n - 1) / n;
    std::vector<std::vector<Unit>> parts;
    for (size_t i = 0; i < c.size(); i += chunk) parts.emplace_back(c.begin() + i, c.begin() + std::min(c.size(), i + chunk));
    bool reduced = false;
    for (const auto& p : parts)
      if (fixes(p)) {
        c = p, n = 2, reduced = true;
        break;
      }
    if (!reduced && parts.size() > 2)
      for (size_t i = 0; i < parts.size() && !reduced; ++i) {
        std::vector<Unit> comp;
        for (size_t j = 0; j < parts.size(); ++j)
          if (j != i) comp.insert(comp.end(), parts[j].begin(), parts[j].end());
        if (fixes(comp)) c = comp, n = std::max<size_t>(n - 1, 2), reduced = true;
      }
    if (reduced) continue;
    if (n >= c.size()) break;
    n = std::min(2 * n, c.size());
  }
  return c;
}

// The samples of the units `c`: rank, micro-batch, row, dataset index and, when the data module
// names it, the source.
nlohmann::json sample_records(const std::vector<LoadedCapture>& caps, const std::vector<StepOutcome>& whole,
                              const std::vector<Unit>& c) {
  nlohmann::json samples = nlohmann::json::array();
  for (const auto& [k, m, r] : c) {
    const int64_t di = caps[k].batches[m].indices[static_cast<size_t>(r)];
    nlohmann::json s = {{"rank", caps[k].info.value("rank", int64_t{0})}, {"micro_batch", m}, {"row", r}, {"dataset_index", di}, {"split", "train"}};
    auto it = whole[k].sources.find(di);
    if (it != whole[k].sources.end() && !it->second.empty()) s["source"] = it->second;
    samples.push_back(s);
  }
  return samples;
}

}  // namespace

nlohmann::json bisect_capture(const std::string& path, const BisectOptions& options) {
  const auto given = load_capture(path);
  const auto& info = given.info;
  const std::vector<LoadedCapture> caps = bisection_captures(given);
  const bool spike = info.value("kind", "") == "spike";
  const auto thr = spike_thresholds(info);
  ReplayVariant base;
  base.device = default_replay_device(given, options.replay);
  base.allow_changed_plugins = options.replay.allow_changed_plugins;

  int64_t trials = 0, failed_trials = 0;
  std::string last_error;
  std::vector<std::string> batch_dependent;
  // One trial: each rank's step on its remaining rows. Bad: any rank non-finite; for a spike, the
  // step's loss as training saw it (the mean over the ranks that have rows) over the threshold, or
  // with one process the recorded metrics as in diagnose.
  auto is_bad = [&](const std::vector<Unit>& units) {
    ++trials;
    try {
      std::vector<std::vector<Row>> per_rank(caps.size());
      for (const auto& [k, m, r] : units) per_rank[k].emplace_back(m, r);
      double loss_sum = 0;
      int64_t ranks = 0;
      for (size_t k = 0; k < caps.size(); ++k) {
        if (per_rank[k].empty()) continue;
        ReplayVariant v = base;
        v.batches = subset(caps[k].batches, per_rank[k], !batch_dependent.empty());
        auto o = replay_step(caps[k], v);
        if (caps.size() == 1) return bad(o, spike, thr);
        if (!o.finite()) return true;
        loss_sum += o.mean_loss(), ++ranks;
      }
      return spike && ranks > 0 && std::isfinite(thr.loss) && loss_sum / static_cast<double>(ranks) > thr.loss;
    } catch (const c10::Error& e) {
      ++failed_trials, last_error = e.what_without_backtrace();
      return false;
    } catch (const std::exception& e) {
      ++failed_trials, last_error = e.what();  // e.g. BatchNorm in training on one row
      return false;
    }
  };

  std::vector<Unit> all;
  for (size_t k = 0; k < caps.size(); ++k)
    for (size_t m = 0; m < caps[k].batches.size(); ++m)
      for (int64_t r = 0; r < caps[k].batches[m].batch_size(); ++r) all.emplace_back(k, m, r);
  // The whole step once per rank: sources, batch-dependent layers, the first non-finite op.
  std::vector<StepOutcome> whole;
  for (const auto& cap : caps) {
    ReplayVariant v = base;
    whole.push_back(replay_step(cap, v));
  }
  batch_dependent = whole.front().batch_dependent;
  nlohmann::json notes = nlohmann::json::array();
  if (!is_bad(all))
    return {{"capture", given.dir}, {"step", info.value("step", int64_t{-1})}, {"reproduced", false}, {"samples", nlohmann::json::array()},
            {"trials", trials}, {"notes", {"the captured step is not bad when replayed: there is nothing to narrow down"}}};
  if (caps.size() > 1 && spike && info["spike"].contains("grad_norm"))
    notes.push_back("data parallel: the trials judge the spike by the loss averaged over the ranks (the gradient norm needs the "
                    "all-reduce, which one process does not reproduce)");

  // The rows whose removal makes the step normal: the batch without them is not bad. (Asking which
  // subset alone is bad would not do: a few ordinary rows alone can exceed a threshold set by
  // whole-batch means.) The empty remainder counts as fixed without running.
  auto without = [&](const std::vector<Unit>& s) {
    std::vector<Unit> sorted_s = s, rest;
    std::sort(sorted_s.begin(), sorted_s.end());
    for (const auto& u : all)
      if (!std::binary_search(sorted_s.begin(), sorted_s.end(), u)) rest.push_back(u);
    return rest;
  };
  auto fixes = [&](const std::vector<Unit>& s) {
    const auto rest = without(s);
    return rest.empty() || !is_bad(rest);
  };
  // Per-row evidence first: each rank's first non-finite op's non-finite rows, when that op keeps
  // the rows of a single micro-batch.
  std::vector<Unit> c = all, seed;
  for (size_t k = 0; k < caps.size(); ++k) {
    const auto& f = whole[k].first;
    if (f && caps[k].batches.size() == 1 && f->output_rows == caps[k].batches[0].batch_size() &&
        static_cast<int64_t>(f->nonfinite_rows.size()) < caps[k].batches[0].batch_size())
      for (int64_t r : f->nonfinite_rows) seed.emplace_back(k, 0, r);
  }
  if (!seed.empty() && fixes(seed)) c = seed;
  c = ddmin(std::move(c), fixes);
  std::sort(c.begin(), c.end());
  // Confirmation both ways: the batch without these rows is not bad (by construction, unless they are
  // every row), and these rows alone are.
  const bool rest_bad = c.size() == all.size();
  const bool alone_bad = is_bad(c);

  const nlohmann::json samples = sample_records(caps, whole, c);
  if (!batch_dependent.empty())
    notes.push_back(fmt::format(
        "the model has batch-dependent layers in training ({}{}): a subset's batch statistics differ from the whole batch's, so "
        "each trial is a different computation (a single row runs as two copies of itself); the result is confirmed by the "
        "batch without these rows being {} and the rows alone being {}",
        batch_dependent.front(), batch_dependent.size() > 1 ? fmt::format(" and {} more", batch_dependent.size() - 1) : "",
        rest_bad ? "bad" : "fine", alone_bad ? "bad" : "fine"));
  if (rest_bad) notes.push_back("no proper subset of the rows could be removed to make the step normal: the step is bad as a whole");
  if (failed_trials > 0)
    notes.push_back(fmt::format("{} of {} trials could not run and counted as not bad (last error: {})", failed_trials, trials, last_error));
  nlohmann::json report = {{"capture", given.dir},
                           {"step", info.value("step", int64_t{-1})},
                           {"kind", spike ? "spike" : "nonfinite"},
                           {"world_size", caps.size()},
                           {"reproduced", true},
                           {"samples", samples},
                           {"rows_in_step", all.size()},
                           {"rest_bad", rest_bad},
                           {"alone_bad", alone_bad},
                           {"trials", trials},
                           {"notes", notes}};
  if (!options.quarantine.empty())
    report["quarantine"] = write_quarantine(options.quarantine, samples, given.dir, options.replace_quarantine);
  return report;
}

std::string format_bisection(const nlohmann::json& r) {
  std::string out = fmt::format("Bisection of {} (step {})\n", r["capture"].get<std::string>(), r["step"].get<int64_t>());
  if (!r["reproduced"].get<bool>()) {
    for (const auto& n : r["notes"]) out += fmt::format("  {}\n", n.get<std::string>());
    return out;
  }
  const std::string what = r["kind"].get<std::string>() == "spike" ? "a spike" : "non-finite";
  out += fmt::format("  without {} of the step's {} rows the step is {}; those rows alone are {} ({} trials):\n", r["samples"].size(),
                     r["rows_in_step"].get<size_t>(), r["rest_bad"].get<bool>() ? "still " + what : "normal",
                     r["alone_bad"].get<bool>() ? what : "normal", r["trials"].get<int64_t>());
  for (const auto& s : r["samples"])
    out += fmt::format("    dataset index {} ({} split; {}row {} of micro-batch {}){}\n", s["dataset_index"].get<int64_t>(),
                       s["split"].get<std::string>(),
                       r.value("world_size", size_t{1}) > 1 ? fmt::format("rank {}, ", s["rank"].get<int64_t>()) : "",
                       s["row"].get<int64_t>(), s["micro_batch"].get<size_t>(),
                       s.contains("source") ? ": " + s["source"].get<std::string>() : "");
  for (const auto& n : r["notes"]) out += fmt::format("  note: {}\n", n.get<std::string>());
  if (r.contains("quarantine")) out += fmt::format("  quarantine written to {}\n", r["quarantine"]["path"].get<std::string>());
  return out;
}

}  // namespace strobe::capture
