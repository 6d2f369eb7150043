#include "runner/replay.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/checkpoint_keys.h"
#include "strobe/config/config.h"
#include "strobe/core/capture.h"
#include "strobe/core/checkpoint_view.h"
#include "strobe/core/forensics.h"
#include "strobe/core/fp8.h"
#include "strobe/core/master_weights.h"
#include "runner/experiment_builder.h"
#include "runner/spike_thresholds.h"

namespace strobe::capture {

namespace fs = std::filesystem;

namespace {

// Observes the replayed step just before the optimizer: which gradients are non-finite.
class GradientObserver : public Callback, public InStepHooks {
 public:
  std::string name() const override { return "replay_observer"; }
  InStepHooks* in_step_hooks() override { return this; }
  void on_before_optimizer_step(TrainerView& t, Module& m, torch::optim::Optimizer&) override {
    seen = true;
    double sq = 0;
    for (const auto& p : m.net().named_parameters()) {
      const auto& g = p.value().grad();
      if (!g.defined()) continue;
      if (!torch::isfinite(g).all().item<bool>()) nonfinite.push_back(p.key());
      sq += g.to(torch::kDouble).square().sum().item<double>();
    }
    // Under 16-mixed the gradients are still scaled here: the norm is not comparable, so left NaN.
    grad_norm = t.config().precision == Precision::k16Mixed ? NAN : std::sqrt(sq);
  }
  bool seen = false;
  double grad_norm = NAN;
  std::vector<std::string> nonfinite;
};

std::vector<std::string> sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

LoadedCapture load_capture(const std::string& path) {
  LoadedCapture cap;
  cap.dir = resolve_capture_dir(path);
  cap.file = (fs::path(cap.dir) / kCheckpointFile).string();
  cap.data = checkpoint::load_checkpoint_file(cap.file);
  const auto& d = cap.data;
  const std::string& file = cap.file;
  const CheckpointView view(d, file);
  if (!d.has_blob(checkpoint_keys::kCapture) || !d.has_blob(checkpoint_keys::kCaptureBatches) || view.config() == nullptr)
    throw checkpoint::CheckpointError(fmt::format("{}: a checkpoint but not a NaN capture (no capture record)", file));
  try {
    cap.info = nlohmann::json::parse(d.blob(checkpoint_keys::kCapture));
  } catch (const std::exception& e) {
    throw checkpoint::CheckpointError(fmt::format("{}: the capture record is not valid JSON: {}", file, e.what()));
  }
  // The capture against its own record: one that lacks micro-batches would replay another step.
  if (!cap.info.is_object() || !cap.info.contains("micro_batches") || !cap.info["micro_batches"].is_number_unsigned())
    throw checkpoint::CheckpointError(fmt::format("{}: the capture record has no micro_batches count", file));
  try {
    cap.batches = get_batches(d);
  } catch (const checkpoint::CheckpointError& e) {
    throw checkpoint::CheckpointError(fmt::format("{}: {}", file, e.what()));
  }
  if (const size_t recorded = cap.info["micro_batches"].get<size_t>(); cap.batches.size() != recorded)
    throw checkpoint::CheckpointError(fmt::format("{}: an incomplete capture: its record says {} micro-batch(es), it holds {}",
                                                  file, recorded, cap.batches.size()));
  cap.config = std::make_shared<const config::SavedConfig>(view.require_config(), file + " (resolved config)");
  cap.captured_device = cap.info.value("device", "cpu");
  cap.fp8 = cap.config->leaf("trainer.fp8.enabled") == "true";
  return cap;
}

std::vector<LoadedCapture> rank_captures(const LoadedCapture& cap) {
  const int64_t world = cap.info.value("world_size", int64_t{1});
  if (world <= 1) return {};
  const int64_t rank = cap.info.value("rank", int64_t{0});
  // Rank 0 writes <dir>/step_<N>, rank r <dir>/rank<r>/step_<N> (callbacks/nan_capture.cpp).
  const fs::path here(cap.dir);
  const fs::path base = rank == 0 ? here.parent_path() : here.parent_path().parent_path();
  const std::string name = here.filename().string();
  std::vector<LoadedCapture> out;
  for (int64_t r = 0; r < world; ++r) {
    if (r == rank) {
      out.push_back(cap);
      continue;
    }
    const fs::path dir = r == 0 ? base / name : base / fmt::format("rank{}", r) / name;
    if (!fs::exists(dir / kCheckpointFile))
      throw checkpoint::CheckpointError(fmt::format("{}: a capture of {} ranks, but rank {}'s part ({}) is missing", cap.dir, world, r,
                                                    dir.string()));
    out.push_back(load_capture(dir.string()));
    if (out.back().info.value("step", int64_t{-1}) != cap.info.value("step", int64_t{-2}))
      throw checkpoint::CheckpointError(fmt::format("{}: rank {}'s part ({}) is of another step", cap.dir, r, dir.string()));
  }
  return out;
}

std::string default_replay_device(const LoadedCapture& cap, const ReplayOptions& options) {
  return options.device.value_or(torch::Device(cap.captured_device).is_cuda() && !torch::cuda::is_available()
                                     ? std::string("cpu")
                                     : cap.captured_device);
}

namespace {

// Floating tensors of a batch in float64 (the float64 replay).
Batch to_float64(const Batch& b) {
  Batch out = b;
  for (auto& [k, t] : out.tensors)
    if (at::isFloatingType(t.scalar_type())) t = t.to(torch::kDouble);
  return out;
}

struct DefaultDtype {
  caffe2::TypeMeta saved = at::get_default_dtype();
  explicit DefaultDtype(caffe2::TypeMeta t) { at::set_default_dtype(t); }
  ~DefaultDtype() { at::set_default_dtype(saved); }
};

}  // namespace

StepOutcome replay_step(const LoadedCapture& cap, const ReplayVariant& v) {
  const std::string device = v.float64 ? std::string("cpu") : v.device;
  auto doc = cap.config->document();
  // The step alone: no callbacks, files, progress bar or loggers; the captured device unless asked.
  doc.apply_override("callbacks=[]");
  doc.apply_override("trainer.enable_checkpointing=false");
  doc.apply_override("trainer.enable_progress_bar=false");
  doc.apply_override("trainer.enable_model_summary=false");
  doc.apply_override("trainer.device=" + device);
  doc.apply_override("trainer.cuda_graphs=false");  // the step runs eagerly, op by op, to be observed
  doc.apply_override("model.init_from=null");  // the capture's checkpoint holds the weights (the file may be gone)
  // Replay may change the precision, which a resume may not: the checkpoint holds fp32 weights (the
  // masters under bf16-master), which is what a "32" run loads; no loss scaler is restored.
  if (v.precision) doc.apply_override("trainer.precision=" + *v.precision);
  if (v.float64) doc.apply_override("trainer.precision=32");
  const bool fp8_off =
      cap.fp8 && (v.fp8_off || v.float64 || (v.precision && !fp8_runs_under(parse_precision(*v.precision))));
  if (fp8_off) doc.apply_override("trainer.fp8.enabled=false");
  RunOptions ro;
  ro.stage = Stage::Fit;
  ro.create_run_dir = false;
  ro.allow_changed_plugins = v.allow_changed_plugins;
  auto observer = std::make_shared<GradientObserver>();
  ro.extra_callbacks.push_back(observer);
  auto run = build_run(doc, ro);
  // Every captured micro-batch holds what the data's batches hold (a damaged capture missing a tensor
  // is refused naming it, not run into the model).
  const auto keys = run->datamodule->info().batch_keys;
  for (size_t i = 0; i < cap.batches.size(); ++i)
    for (const auto& k : keys)
      if (!cap.batches[i].has(k))
        throw checkpoint::CheckpointError(fmt::format("{}: the capture's batch {} lacks its tensor '{}' (capture/batch/{}/{})",
                                                      cap.file, i, k, i, k));
  StepOutcome out;
  out.device = device;
  out.plugin_changes = run->plugin_changes;
  {
    checkpoint::CheckpointData d = cap.data;
    CheckpointEditor edit(d);
    if (v.precision || v.float64 || fp8_off) edit.set_config(run->resolved_yaml);  // the precision change is replay's own
    // The log accumulators start empty: the captured ones may hold the failing step's own NaN, which
    // a replay's logging would add to (a non-finite op that is not the step's).
    edit.drop_logger_sums();
    // A data-parallel rank's part replays in this one process: its own generators (a capture holds
    // this rank's, never a gather), the captured GPU's CUDA generator onto the replay GPU.
    if (cap.info.value("world_size", int64_t{1}) > 1) edit.set_world_size(1);
    const torch::Device from(cap.captured_device), to(device);
    if (from.is_cuda() && to.is_cuda() && from.index() != to.index()) edit.move_cuda_generator(from.index(), to.has_index() ? to.index() : 0);
    run->trainer->resume_state(d);
  }
  if (auto loader = run->datamodule->train_loader())
    for (const auto& b : cap.batches)
      for (int64_t i : b.indices)
        if (i >= 0 && i < loader->dataset().size()) out.sources[i] = loader->dataset().describe(i);
  std::vector<Batch> previous;
  auto indices = cap.info.value("batch_indices", std::vector<int64_t>{});
  if (v.previous_step) {
    // The step before, re-made by the training loader (order and per-sample randomness are functions
    // of seed, epoch and index); its rows are checked against the dataset indices the capture recorded.
    auto loader = run->datamodule->train_loader();
    if (!loader) throw std::runtime_error("the data module has no training loader to re-read the previous step from");
    if (cap.info.value("world_size", int64_t{1}) > 1)
      throw std::runtime_error("a data-parallel rank's previous batches are not re-made in one process (its loader shard is the rank's)");
    const int64_t n = static_cast<int64_t>(cap.batches.size());
    int64_t epoch = cap.info.value("epoch", int64_t{0});
    int64_t first = indices.empty() ? -1 : indices.front() - n;
    if (first < 0 && epoch > 0) --epoch, first = loader->num_batches() - n;
    if (first < 0) throw std::runtime_error("the captured step is the run's first: there is no previous step");
    const auto recorded = cap.info.value("previous_dataset_indices", std::vector<std::vector<int64_t>>{});
    indices.clear();
    for (int64_t i = 0; i < n; ++i) {
      previous.push_back(loader->make_batch(epoch, first + i));
      indices.push_back(first + i);
      if (static_cast<size_t>(i) < recorded.size() && !recorded[i].empty() && recorded[i] != previous.back().indices)
        out.notes.push_back(fmt::format("the re-read batch {} of epoch {} holds other samples than the capture recorded", first + i, epoch));
    }
  }
  const auto& batches = v.previous_step ? previous : v.batches ? *v.batches : cap.batches;
  for (const auto& m : run->module->net().named_modules("", /*include_self=*/false))
    if (m.value()->is_training() && is_batch_norm(*m.value())) out.batch_dependent.push_back(m.key());
  for (const auto& p : run->module->net().named_parameters())
    if (!torch::isfinite(p.value()).all().item<bool>()) out.nonfinite_params.push_back(p.key());
  for (size_t i = 0; i < batches.size(); ++i)
    for (const auto& [k, t] : batches[i].tensors)
      if (at::isFloatingType(t.scalar_type()) && !torch::isfinite(t).all().item<bool>())
        out.notes.push_back(fmt::format("batch {} tensor '{}' holds non-finite values", i, k));

  if (v.float64) {
    auto& net = run->module->net();
    net.to(torch::kDouble);
    net.train();
    DefaultDtype dt(caffe2::TypeMeta::Make<double>());
    NonFiniteTracer tracer(net);
    auto& dm = *run->datamodule;
    for (size_t i = 0; i < batches.size(); ++i) {
      Batch b = dm.on_before_batch_transfer(batches[i], 0);
      b = dm.on_after_batch_transfer(dm.transfer_batch_to_device(b, torch::Device(torch::kCPU), 0), 0);
      auto loss = run->module->training_step(to_float64(b), i < indices.size() ? indices[i] : 0);
      out.losses.push_back(loss.detach());
      if (loss.requires_grad()) (loss / static_cast<double>(batches.size())).backward();
    }
    out.first = tracer.first();
    out.traced = tracer.ops_observed();
    double sq = 0;
    for (const auto& p : net.named_parameters()) {
      const auto& g = p.value().grad();
      if (!g.defined()) continue;
      if (!torch::isfinite(g).all().item<bool>()) out.nonfinite_grads.push_back(p.key());
      sq += g.to(torch::kDouble).square().sum().item<double>();
    }
    out.grad_norm = std::sqrt(sq);
  } else {
    NonFiniteTracer tracer(run->module->net());
    for (size_t i = 0; i < batches.size(); ++i)
      out.losses.push_back(run->trainer->run_batch(batches[i], i < indices.size() ? indices[i] : 0));
    out.first = tracer.first();
    out.traced = tracer.ops_observed();
    out.nonfinite_grads = observer->nonfinite;
    out.grad_norm = observer->grad_norm;
  }
  for (auto& l : out.losses) l = l.defined() ? l.to(torch::kCPU) : torch::full({}, NAN);
  return out;
}

bool StepOutcome::finite() const {
  for (const auto& l : losses)
    if (!torch::isfinite(l).all().item<bool>()) return false;
  return nonfinite_grads.empty() && !first;
}

double StepOutcome::mean_loss() const {
  double s = 0;
  for (const auto& l : losses) s += l.to(torch::kDouble).item<double>();
  return losses.empty() ? NAN : s / static_cast<double>(losses.size());
}

nlohmann::json replay_capture(const std::string& path, const ReplayOptions& options) {
  const auto cap = load_capture(path);
  const std::string device = default_replay_device(cap, options);
  ReplayVariant v;
  v.device = device;
  v.allow_changed_plugins = options.allow_changed_plugins;
  const auto run = replay_step(cap, v);
  const auto& info = cap.info;
  const auto& dir = cap.dir;
  const auto& captured_device = cap.captured_device;
  const auto indices = info.value("batch_indices", std::vector<int64_t>{});

  nlohmann::json notes = nlohmann::json::array();
  for (const auto& change : run.plugin_changes) notes.push_back(change);
  if (device != captured_device)
    notes.push_back(fmt::format("captured on {}, replayed on {}: bits may differ across devices", captured_device, device));
  for (const auto& p : run.nonfinite_params) notes.push_back(fmt::format("parameter {} was already non-finite before the step", p));
  for (const auto& n : run.notes) notes.push_back(n);
  const auto& losses = run.losses;
  const auto& first = run.first;

  nlohmann::json cap_losses = info.value("losses", nlohmann::json::array());
  nlohmann::json rep_losses = nlohmann::json::array();
  bool bits_equal = losses.size() == cap_losses.size();
  for (size_t i = 0; i < losses.size(); ++i) {
    const auto bits = tensor_bits(losses[i]);
    rep_losses.push_back({{"value", fmt::format("{:.9g}", losses[i].to(torch::kDouble).item<double>())}, {"bits", bits}});
    if (i >= cap_losses.size() || cap_losses[i].value("bits", "") != bits) bits_equal = false;
  }
  const bool grads_checked = info.value("grads_checked", false);
  auto cap_grads = sorted(info.value("nonfinite_grads", std::vector<std::string>{}));
  auto rep_grads = sorted(run.nonfinite_grads);
  const bool grads_equal = !grads_checked || cap_grads == rep_grads;
  if (!grads_checked) notes.push_back("the gradients were not checked during training: only the loss bits are compared");

  nlohmann::json report = {{"capture", dir},
                           {"step", info.value("step", info.value("global_step", int64_t{-1}) + 1)},
                           {"global_step", info.value("global_step", int64_t{-1})},
                           {"epoch", info.value("epoch", int64_t{-1})},
                           {"batch_in_epoch", info.value("batch_in_epoch", int64_t{-1})},
                           {"batch_indices", indices},
                           {"captured_on", captured_device},
                           {"replayed_on", device},
                           {"precision", info.value("precision", "")},
                           {"fp8", cap.fp8},
                           {"exact", bits_equal && grads_equal},
                           {"loss", {{"captured", cap_losses}, {"replayed", rep_losses}, {"bits_equal", bits_equal}}},
                           {"nonfinite_grads",
                            {{"captured", cap_grads}, {"replayed", rep_grads}, {"equal", grads_equal}, {"checked", grads_checked}}},
                           {"ops_traced", run.traced},
                           {"first_nonfinite", first ? first->to_json() : nlohmann::json(nullptr)},
                           {"kind", info.value("kind", "nonfinite")},
                           {"spike", info.value("spike", nlohmann::json(nullptr))},
                           {"notes", notes}};
  // Data parallel: every rank's part, each rank's micro-batches replayed on this one device.
  const auto parts = rank_captures(cap);
  if (parts.empty()) return report;
  nlohmann::json ranks = nlohmann::json::array(), culprits = nlohmann::json::array();
  std::set<std::string> union_grads;
  bool all_bits = true;
  nlohmann::json first_any = nullptr;
  for (const auto& part : parts) {
    const int64_t r = part.info.value("rank", int64_t{0});
    const StepOutcome o = part.dir == cap.dir ? run : replay_step(part, v);
    union_grads.insert(o.nonfinite_grads.begin(), o.nonfinite_grads.end());
    const auto rec = part.info.value("losses", nlohmann::json::array());
    nlohmann::json cap_l = nlohmann::json::array(), rep_l = nlohmann::json::array();
    bool bits = o.losses.size() == rec.size();
    for (size_t i = 0; i < o.losses.size(); ++i) {
      rep_l.push_back(fmt::format("{:.9g}", o.losses[i].to(torch::kDouble).item<double>()));
      if (i >= rec.size() || rec[i].value("bits", "") != tensor_bits(o.losses[i])) bits = false;
    }
    for (const auto& l : rec) cap_l.push_back(l.value("value", "?"));
    all_bits = all_bits && bits;
    // A rank is at fault when its own step is non-finite, or, for a spike, when its own loss is over
    // the recorded threshold (mean + zscore x std of the window).
    const double loss_threshold = spike_thresholds(info).loss;
    const bool bad_rank = !o.finite() || (std::isfinite(loss_threshold) && o.mean_loss() > loss_threshold);
    if (bad_rank) culprits.push_back(r);
    if (bad_rank && first_any.is_null() && o.first) {
      first_any = o.first->to_json();
      first_any["rank"] = r;
    }
    ranks.push_back({{"rank", r},
                     {"capture", part.dir},
                     {"loss", {{"captured", cap_l}, {"replayed", rep_l}, {"bits_equal", bits}}},
                     {"loss_nonfinite_captured", part.info.value("loss_nonfinite", false)},
                     {"nonfinite", !o.finite()},
                     {"at_fault", bad_rank},
                     {"first_nonfinite", o.first ? o.first->to_json() : nlohmann::json(nullptr)}});
  }
  const std::vector<std::string> replayed_union(union_grads.begin(), union_grads.end());
  const bool union_equal = !grads_checked || cap_grads == replayed_union;
  report["world_size"] = parts.size();
  report["ranks"] = ranks;
  report["culprit_ranks"] = culprits;
  report["exact"] = all_bits && union_equal;
  report["nonfinite_grads"]["replayed"] = replayed_union;
  report["nonfinite_grads"]["equal"] = union_equal;
  if (!first_any.is_null()) report["first_nonfinite"] = first_any;
  report["notes"].push_back(
      "data parallel: each rank's micro-batches are replayed on this device from its own capture (its RNG, its batches); every "
      "rank's losses are compared bit for bit. The all-reduced gradients are compared as the set of non-finite tensors (the "
      "union of the ranks' local ones): the collective's reduction order is not reproduced on one device, so their values are "
      "not compared");
  return report;
}

std::string format_replay_report(const nlohmann::json& r) {
  std::string out = fmt::format("Replay of {}\n  step {} (epoch {}, batch {} of the epoch), captured on {}, replayed on {}, precision {}\n",
                                r["capture"].get<std::string>(), r["step"].get<int64_t>(), r["epoch"].get<int64_t>(),
                                r["batch_in_epoch"].get<int64_t>(), r["captured_on"].get<std::string>(),
                                r["replayed_on"].get<std::string>(), r["precision"].get<std::string>() + (r.value("fp8", false) ? " with trainer.fp8" : ""));
  if (r.value("kind", "") == "spike" && r["spike"].is_object())
    out += fmt::format("  captured as a spike: {}\n", r["spike"].value("description", std::string("?")));
  const auto& loss = r["loss"];
  for (size_t i = 0; i < loss["replayed"].size(); ++i) {
    const auto& rep = loss["replayed"][i];
    std::string cap = i < loss["captured"].size() ? loss["captured"][i].value("value", "?") : "?";
    out += fmt::format("  loss (micro-batch {}): captured {}, replayed {}\n", i, cap, rep.value("value", "?"));
  }
  if (r.contains("ranks"))
    for (const auto& k : r["ranks"])
      out += fmt::format("  rank {} ({}): loss captured {}, replayed {}: {}{}\n", k["rank"].get<int64_t>(), k["capture"].get<std::string>(),
                         k["loss"]["captured"].dump(), k["loss"]["replayed"].dump(),
                         k["loss"]["bits_equal"].get<bool>() ? "same bits" : "OTHER bits", k["nonfinite"].get<bool>() ? ", non-finite" : k["at_fault"].get<bool>() ? ", over the spike threshold" : "");
  const auto& g = r["nonfinite_grads"];
  if (g["checked"].get<bool>())
    out += fmt::format("  non-finite gradients: captured {}, replayed {}\n", g["captured"].size(), g["replayed"].size());
  out += fmt::format("  reproduction: {}\n", r["exact"].get<bool>() ? "EXACT (same loss bits, same non-finite gradients)"
                                                                     : "NOT exact (see the comparison above)");
  const auto& f = r["first_nonfinite"];
  if (f.is_null()) {
    out += "  no operation produced a non-finite value in the replayed step\n";
  } else {
    out += fmt::format("  first non-finite value: {}{} in {} ({}), {}\n", f.contains("rank") ? fmt::format("(rank {}) ", f["rank"].get<int64_t>()) : "",
                       f["op"].get<std::string>(), f["module"].get<std::string>(), f["phase"].get<std::string>(), f["note"].get<std::string>());
    auto line = [](const nlohmann::json& s) {
      return fmt::format("    {:<28} shape {} {}: min {:.6g} max {:.6g} mean|x| {:.6g} nan {} +inf {} -inf {}\n",
                         s["name"].get<std::string>(), s["shape"].dump(), s["dtype"].get<std::string>(), s["min"].get<double>(),
                         s["max"].get<double>(), s["mean_abs"].get<double>(), s["nan"].get<int64_t>(), s["pos_inf"].get<int64_t>(),
                         s["neg_inf"].get<int64_t>());
    };
    for (const auto& s : f["inputs"]) out += line(s);
    out += line(f["output"]);
  }
  for (const auto& n : r["notes"]) out += fmt::format("  note: {}\n", n.get<std::string>());
  return out;
}

}  // namespace strobe::capture
