#include "runner/replay.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/config.h"
#include "strobe/core/capture.h"
#include "strobe/core/checkpoint_view.h"
#include "strobe/core/forensics.h"
#include "runner/experiment_builder.h"

namespace strobe::capture {

namespace fs = std::filesystem;

namespace {

// Observes the replayed step just before the optimizer: which gradients are non-finite.
class GradientObserver : public Callback, public InStepHooks {
 public:
  std::string name() const override { return "replay_observer"; }
  InStepHooks* in_step_hooks() override { return this; }
  void on_before_optimizer_step(TrainerView&, Module& m, torch::optim::Optimizer&) override {
    seen = true;
    for (const auto& p : m.net().named_parameters()) {
      const auto& g = p.value().grad();
      if (g.defined() && !torch::isfinite(g).all().item<bool>()) nonfinite.push_back(p.key());
    }
  }
  bool seen = false;
  std::vector<std::string> nonfinite;
};

std::vector<std::string> sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

nlohmann::json replay_capture(const std::string& path, const ReplayOptions& options) {
  const std::string dir = resolve_capture_dir(path);
  const std::string file = (fs::path(dir) / kCheckpointFile).string();
  auto d = checkpoint::load_checkpoint_file(file);
  const CheckpointView view(d, file);
  if (!d.has_blob("capture") || !d.has_blob("capture_batches") || view.config() == nullptr)
    throw checkpoint::CheckpointError(fmt::format("{}: a checkpoint but not a NaN capture (no capture record)", file));
  nlohmann::json info;
  try {
    info = nlohmann::json::parse(d.blob("capture"));
  } catch (const std::exception& e) {
    throw checkpoint::CheckpointError(fmt::format("{}: the capture record is not valid JSON: {}", file, e.what()));
  }
  // The capture against its own record: one that lacks micro-batches would replay another step.
  if (!info.is_object() || !info.contains("micro_batches") || !info["micro_batches"].is_number_unsigned())
    throw checkpoint::CheckpointError(fmt::format("{}: the capture record has no micro_batches count", file));
  std::vector<Batch> batches;
  try {
    batches = get_batches(d);
  } catch (const checkpoint::CheckpointError& e) {
    throw checkpoint::CheckpointError(fmt::format("{}: {}", file, e.what()));
  }
  if (const size_t recorded = info["micro_batches"].get<size_t>(); batches.size() != recorded)
    throw checkpoint::CheckpointError(fmt::format("{}: an incomplete capture: its record says {} micro-batch(es), it holds {}",
                                                  file, recorded, batches.size()));
  const std::string captured_device = info.value("device", "cpu");
  const std::string device = options.device.value_or(torch::Device(captured_device).is_cuda() && !torch::cuda::is_available()
                                                         ? std::string("cpu")
                                                         : captured_device);

  auto doc = config::Document::load_string(view.require_config(), file + " (resolved config)");
  // The step alone: no callbacks, files, progress bar or loggers; the captured device unless asked.
  doc.apply_override("callbacks=[]");
  doc.apply_override("trainer.enable_checkpointing=false");
  doc.apply_override("trainer.enable_progress_bar=false");
  doc.apply_override("trainer.enable_model_summary=false");
  doc.apply_override("trainer.device=" + device);
  doc.apply_override("trainer.cuda_graphs=false");  // the step runs eagerly, op by op, to be observed
  doc.apply_override("model.init_from=null");  // the capture's checkpoint holds the weights (the file may be gone)
  RunOptions ro;
  ro.stage = Stage::Fit;
  ro.create_run_dir = false;
  ro.allow_changed_plugins = options.allow_changed_plugins;
  auto observer = std::make_shared<GradientObserver>();
  ro.extra_callbacks.push_back(observer);
  auto run = build_run(doc, ro);
  run->trainer->resume_state(d);
  const auto indices = info.value("batch_indices", std::vector<int64_t>{});

  nlohmann::json notes = nlohmann::json::array();
  for (const auto& change : run->plugin_changes) notes.push_back(change);
  if (device != captured_device)
    notes.push_back(fmt::format("captured on {}, replayed on {}: bits may differ across devices", captured_device, device));
  for (const auto& p : run->module->net().named_parameters())
    if (!torch::isfinite(p.value()).all().item<bool>())
      notes.push_back(fmt::format("parameter {} was already non-finite before the step", p.key()));
  for (size_t i = 0; i < batches.size(); ++i)
    for (const auto& [k, t] : batches[i].tensors)
      if (at::isFloatingType(t.scalar_type()) && !torch::isfinite(t).all().item<bool>())
        notes.push_back(fmt::format("batch {} tensor '{}' holds non-finite values", i, k));

  std::vector<torch::Tensor> losses;
  std::optional<NonFiniteEvent> first;
  int64_t traced = 0;
  {
    NonFiniteTracer tracer(run->module->net());
    for (size_t i = 0; i < batches.size(); ++i)
      losses.push_back(run->trainer->run_batch(batches[i], i < indices.size() ? indices[i] : 0));
    first = tracer.first();
    traced = tracer.ops_observed();
  }

  nlohmann::json cap_losses = info.value("losses", nlohmann::json::array());
  nlohmann::json rep_losses = nlohmann::json::array();
  bool bits_equal = losses.size() == cap_losses.size();
  for (size_t i = 0; i < losses.size(); ++i) {
    auto host = losses[i].defined() ? losses[i].to(torch::kCPU) : torch::full({}, NAN);
    const auto bits = tensor_bits(host);
    rep_losses.push_back({{"value", fmt::format("{:.9g}", host.to(torch::kDouble).item<double>())}, {"bits", bits}});
    if (i >= cap_losses.size() || cap_losses[i].value("bits", "") != bits) bits_equal = false;
  }
  const bool grads_checked = info.value("grads_checked", false);
  auto cap_grads = sorted(info.value("nonfinite_grads", std::vector<std::string>{}));
  auto rep_grads = sorted(observer->nonfinite);
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
                           {"exact", bits_equal && grads_equal},
                           {"loss", {{"captured", cap_losses}, {"replayed", rep_losses}, {"bits_equal", bits_equal}}},
                           {"nonfinite_grads",
                            {{"captured", cap_grads}, {"replayed", rep_grads}, {"equal", grads_equal}, {"checked", grads_checked}}},
                           {"ops_traced", traced},
                           {"first_nonfinite", first ? first->to_json() : nlohmann::json(nullptr)},
                           {"notes", notes}};
  return report;
}

std::string format_replay_report(const nlohmann::json& r) {
  std::string out = fmt::format("Replay of {}\n  step {} (epoch {}, batch {} of the epoch), captured on {}, replayed on {}, precision {}\n",
                                r["capture"].get<std::string>(), r["step"].get<int64_t>(), r["epoch"].get<int64_t>(),
                                r["batch_in_epoch"].get<int64_t>(), r["captured_on"].get<std::string>(),
                                r["replayed_on"].get<std::string>(), r["precision"].get<std::string>());
  const auto& loss = r["loss"];
  for (size_t i = 0; i < loss["replayed"].size(); ++i) {
    const auto& rep = loss["replayed"][i];
    std::string cap = i < loss["captured"].size() ? loss["captured"][i].value("value", "?") : "?";
    out += fmt::format("  loss (micro-batch {}): captured {}, replayed {}\n", i, cap, rep.value("value", "?"));
  }
  const auto& g = r["nonfinite_grads"];
  if (g["checked"].get<bool>())
    out += fmt::format("  non-finite gradients: captured {}, replayed {}\n", g["captured"].size(), g["replayed"].size());
  out += fmt::format("  reproduction: {}\n", r["exact"].get<bool>() ? "EXACT (same loss bits, same non-finite gradients)"
                                                                     : "NOT exact (see the comparison above)");
  const auto& f = r["first_nonfinite"];
  if (f.is_null()) {
    out += "  no operation produced a non-finite value in the replayed step\n";
  } else {
    out += fmt::format("  first non-finite value: {} in {} ({}), {}\n", f["op"].get<std::string>(), f["module"].get<std::string>(),
                       f["phase"].get<std::string>(), f["note"].get<std::string>());
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
