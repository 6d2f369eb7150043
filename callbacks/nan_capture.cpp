// nan_capture: catches the first non-finite training step and keeps everything that reproduces it
// (docs/NAN_CAPTURE.md; docs/ARCHITECTURE.md, "NaN capture and replay").
//
// - Per step, with no host sync and no deep copy: a ring of the last `keep_last` steps holds the
//   micro-batches as the loader produced them (references to immutable host tensors), the CPU and
//   CUDA generator states, the loop counters, and the step pipeline's record (the device-side
//   verdict, per-gradient norms, the losses, the buffers from before the step).
// - The step pipeline is armed with the configured checks. With `action: stop` the skip flag is
//   sticky: from the failing step on no update is applied, so when the host learns of it (through an
//   asynchronous copy of the verdict into pinned memory, at most keep_last - 1 steps later; it waits
//   for the device only when the ring is full) the weights and optimizer state are still those from
//   before the failing step. It writes <run_dir>/nan/step_<N>/ and stops training with exit status 3.
// - `action: skip_step` drops each non-finite step on the device (buffers restored too), logs it
//   (`train/skipped_steps`, a console line) and trains on; after `max_skips` skips (0: no limit)
//   the next non-finite step is captured and stops the run like `stop`.
// - Under 16-mixed an overflowing gradient is the loss scaler's normal business (skip, back off),
//   so there only a non-finite loss counts.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/checkpoint_keys.h"
#include "strobe/core/callback.h"
#include "strobe/core/capture.h"
#include "strobe/core/checkpoint_view.h"
#include "strobe/core/step_record.h"
#include "strobe/core/trainer_view.h"
#include "strobe/logging/device_readback.h"

namespace strobe {
namespace {

namespace fs = std::filesystem;

struct RingEntry {
  TrainerState loop;  // at the start of the step
  std::vector<Batch> batches;
  std::vector<int64_t> batch_indices;
  RngSnapshot rng;  // this process's generators at the step's start
  StepRecord record;
  bool stepped = false;
  // The step began before this process resumed (a checkpoint taken mid-accumulation): its first
  // micro-batches and its start state are not here, so it can be checked but not captured.
  bool partial = false;
  DeviceReadback flags;  // kFlags: verdict, loss flag, grad flag, spike, spike limit, spike stats
};

// The host copy of a step's flags: [0..2] verdict, loss flag, grad flag; [3] spike; [4] spike limit;
// [5..] StepRecord::spike_stats.
constexpr int64_t kSpikeAt = 3, kStatsAt = 5, kFlags = kStatsAt + kSpikeStats;

class NaNCapture : public Callback {
 public:
  NaNCapture(bool check_grads, bool check_loss, bool stop, int64_t max_skips, int64_t keep_last, std::string dirpath,
             SpikeGuard spike)
      : check_grads_(check_grads), check_loss_(check_loss), stop_(stop), max_skips_(max_skips), keep_last_(keep_last),
        dirpath_(std::move(dirpath)), spike_(spike) {}

  std::string name() const override { return "nan_capture"; }

  void setup(TrainerView& t, Module&, Stage stage) override {
    if (stage != Stage::Fit) return;
    if (dirpath_.empty() && !t.run_dir().empty()) dirpath_ = (fs::path(t.run_dir()) / "nan").string();
    // A capture killed mid-write (kill -9) left its temporary folder and its empty claim: removed.
    if (!dirpath_.empty()) {
      const fs::path base = t.is_global_zero() ? fs::path(dirpath_) : fs::path(dirpath_) / fmt::format("rank{}", t.rank());
      for (const auto& name : capture::remove_capture_leftovers(base.string()))
        fmt::print(stderr, "nan_capture: removed {} (left by a capture that was killed while it was written)\n", (base / name).string());
    }
    StepGuard g;
    // 16-mixed: a non-finite gradient is an overflow the loss scaler handles; only the loss counts.
    g.check_grads = check_grads_ && t.config().precision != Precision::k16Mixed;
    g.check_loss = check_loss_ || (check_grads_ && t.config().precision == Precision::k16Mixed);
    g.sticky = stop_ || (max_skips_ > 0 && skips_ >= max_skips_);
    g.restore_buffers = !g.sticky || (spike_.armed() && !spike_.stop);
    g.snapshot_buffers = true;
    g.spike = spike_;
    t.step_access().arm_step_guard(g);
  }

  void on_train_batch_start(TrainerView& t, Module&, const Batch& batch, int64_t batch_idx) override {
    // A step starts at its first micro-batch, or, after a resume from a checkpoint taken mid-way
    // through an accumulation window, at the first micro-batch this process sees (partial).
    if (t.accumulated_batches() == 0 || ring_.empty() || ring_.back().stepped) {
      RingEntry e;
      e.partial = t.accumulated_batches() > 0;
      e.loop = t.state();
      // The generators a checkpoint's rng entry holds (with CUDA present, its generators even for a
      // CPU run), so a capture has the keys of any checkpoint.
      e.rng = snapshot_rng(torch::cuda::is_available());
      ring_.push_back(std::move(e));
    }
    ring_.back().batches.push_back(batch);
    ring_.back().batch_indices.push_back(batch_idx);
  }

  // After StepPipeline::step(): the record of this step is complete.
  void on_before_zero_grad(TrainerView& t, Module&, torch::optim::Optimizer&) override {
    if (ring_.empty()) return;
    RingEntry& e = ring_.back();
    e.record = t.step_access().step_pipeline().last();
    e.stepped = true;
    const auto& r = e.record;
    auto zero = [&] { return torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(t.device())); };
    std::vector<torch::Tensor> parts = {r.nonfinite.defined() ? r.nonfinite : zero(), r.loss_nonfinite.defined() ? r.loss_nonfinite : zero(),
                                        r.grad_nonfinite.defined() ? r.grad_nonfinite : zero()};
    torch::Tensor flags = torch::stack(parts);
    if (spike_.armed() && r.spike.defined())
      flags = torch::cat({flags, torch::stack({r.spike, r.spike_limit}), r.spike_stats});
    e.flags.start(flags);
    resolve(t, /*drain=*/false);
  }

  void on_train_end(TrainerView& t, Module&) override { resolve(t, /*drain=*/true); }

  nlohmann::json state_dict() const override {
    return {{"skips", skips_}, {"skipped_steps", skipped_steps_}, {"captures", captures_}, {"spikes", spikes_}};
  }
  void load_state_dict(const nlohmann::json& s) override {
    skips_ = s.value("skips", int64_t{0});
    spikes_ = s.value("spikes", int64_t{0});
    skipped_steps_ = s.value("skipped_steps", std::vector<int64_t>{});
    captures_ = s.value("captures", std::vector<std::string>{});
  }

 private:
  // Reads the verdicts of finished steps, oldest first; waits for the oldest only when the ring is
  // full (or at the end of training) — the bound on how late the host learns of a bad step.
  void resolve(TrainerView& t, bool drain) {
    while (!ring_.empty() && !stopped_) {
      RingEntry& e = ring_.front();
      if (!e.stepped) break;
      const bool must = drain || static_cast<int64_t>(ring_.size()) > keep_last_;
      // Data parallel: the verdict is the same on every rank, but when a copy lands is not, so every
      // rank reads it at the same step (when the ring is full): the capture and the stop then happen
      // at the same point everywhere.
      if (e.flags.asynchronous() && t.world_size() > 1 && !must) break;
      if (!e.flags.ready()) {
        if (!must) break;
        e.flags.wait();
      }
      const float* f = e.flags.host().data_ptr<float>();
      if (f[0] != 0.f)
        on_nonfinite(t, e, f[1] != 0.f, f[2] != 0.f);
      else if (e.flags.host().numel() == kFlags && f[kSpikeAt] != 0.f)
        on_spike(t, e, f);
      if (stopped_) break;
      previous_indices_ = dataset_indices(e);
      ring_.pop_front();
    }
    // Entries beyond the ring depth that are still unresolved are kept until their copy lands.
  }

  // One step numbering everywhere (docs/NAN_CAPTURE.md): a step's number is the global step once it
  // has run, i.e. its metrics.csv row, TensorBoard step, console line and capture directory.
  // e.loop holds the counters at the step's start (the steps completed before it).
  static int64_t step_number(const RingEntry& e) { return e.loop.global_step + 1; }

  std::vector<std::string> nonfinite_grads(const RingEntry& e) const {
    std::vector<std::string> names;
    if (!e.record.grad_norms.defined() || !e.record.grad_names) return names;
    auto norms = e.record.grad_norms.to(torch::kCPU);
    const float* p = norms.data_ptr<float>();
    for (int64_t i = 0; i < norms.numel(); ++i)
      if (!std::isfinite(p[i])) names.push_back((*e.record.grad_names)[static_cast<size_t>(i)]);
    return names;
  }

  void on_nonfinite(TrainerView& t, RingEntry& e, bool loss_bad, bool grads_bad) {
    const std::string what = loss_bad && grads_bad ? "loss and gradients" : loss_bad ? "loss" : "gradients";
    const int64_t step = step_number(e);
    const bool capture = stop_ || (max_skips_ > 0 && skips_ >= max_skips_);
    if (!capture) {
      ++skips_;
      skipped_steps_.push_back(step);
      if (skipped_steps_.size() > 1000) skipped_steps_.erase(skipped_steps_.begin());
      auto grads = nonfinite_grads(e);
      if (t.is_global_zero())
        fmt::print(stderr, "nan_capture: non-finite {} at step {} (epoch {}, batch {}): step skipped ({} so far){}\n", what,
                   step, e.loop.epoch, e.loop.batch_in_epoch, skips_,
                   grads.empty() ? "" : fmt::format("; first non-finite gradient: {}", grads.front()));
      t.log_host_at(step, e.loop.epoch, {{"train/skipped_steps", static_cast<double>(skips_)}});  // the skipped step's own row
      if (max_skips_ > 0 && skips_ >= max_skips_) {
        // The budget is spent: from now on a bad step is kept (sticky) and captured exactly.
        StepGuard g;
        g.sticky = true;
        t.step_access().arm_step_guard(g);
        if (t.is_global_zero())
          fmt::print(stderr, "nan_capture: max_skips ({}) reached: the next non-finite step stops the run with a capture\n",
                     max_skips_);
      }
      return;
    }
    if (e.partial) {
      if (t.is_global_zero())
        fmt::print(stderr,
                   "nan_capture: non-finite {} at step {} (epoch {}, batch {}); the update was not applied. The step "
                   "began before this run resumed from a checkpoint taken mid-way through gradient accumulation, so "
                   "it cannot be captured: resume from that checkpoint again to capture it\n",
                   what, step, e.loop.epoch, e.loop.batch_in_epoch);
      stopped_ = true;
      t.request_stop(kExitNaN);
      return;
    }
    const std::string dir = write_capture(t, e, loss_bad, grads_bad);
    captures_.push_back(dir);
    if (t.is_global_zero())
      fmt::print(stderr,
                 "nan_capture: non-finite {} at step {} (epoch {}, batch {}); the update was not applied.\n"
                 "nan_capture: capture written to {}\nnan_capture: replay it with: strobe replay {}\n{}",
                 what, step, e.loop.epoch, e.loop.batch_in_epoch, dir, dir,
                 t.world_size() > 1 ? fmt::format("nan_capture: each of the {} ranks wrote its own capture of its micro-batches "
                                                  "(rank r > 0: {}/rank<r>/step_{})\n",
                                                  t.world_size(), dirpath_, step)
                                    : std::string());
    stopped_ = true;
    t.request_stop(kExitNaN);
  }

  static std::vector<std::vector<int64_t>> dataset_indices(const RingEntry& e) {
    std::vector<std::vector<int64_t>> out;
    for (const auto& b : e.batches) out.push_back(b.indices);
    return out;
  }

  // "loss spike 9.21 (mean 2.1, std 0.31, z 22.9)" for each metric over its threshold; and the record.
  std::pair<std::string, nlohmann::json> describe_spike(const float* f) const {
    const float* st = f + kStatsAt;
    std::string text;
    nlohmann::json j = {{"zscore", spike_.zscore}, {"window", spike_.window}, {"warmup", spike_.warmup},
                        {"action", spike_.stop ? "stop" : "skip_step"}, {"consecutive", static_cast<int64_t>(st[kConsecutive])}};
    auto one = [&](const char* name, const char* label, float v, float m, float sd) {
      const double z = sd > 0 ? (static_cast<double>(v) - m) / sd : INFINITY;
      if (!text.empty()) text += "; ";
      text += fmt::format("{} spike {:.6g} (mean {:.6g}, std {:.6g}, z {:.1f})", label, v, m, sd, z);
      j[name] = {{"value", v}, {"mean", m}, {"std", sd}, {"z", std::isfinite(z) ? nlohmann::json(z) : nlohmann::json("inf")}};
    };
    if (st[kLossOver] != 0.f) one("loss", "loss", st[kLossValue], st[kLossMean], st[kLossStd]);
    if (st[kNormOver] != 0.f) one("grad_norm", "grad-norm", st[kNormValue], st[kNormMean], st[kNormStd]);
    return {text, j};
  }

  void on_spike(TrainerView& t, RingEntry& e, const float* f) {
    const int64_t step = step_number(e);
    auto [text, record] = describe_spike(f);
    ++spikes_;
    t.log_host_at(step, e.loop.epoch, {{"train/spikes", static_cast<double>(spikes_)}});
    const bool limit = f[kSpikeAt + 1] != 0.f;
    if (!limit) {
      if (t.is_global_zero())
        fmt::print(stderr, "nan_capture: {} at step {} (epoch {}, batch {}): step skipped ({} spike(s) so far)\n", text, step,
                   e.loop.epoch, e.loop.batch_in_epoch, spikes_);
      return;
    }
    std::string why;
    if (!spike_.stop)
      why = fmt::format(
          "nan_capture: {} spikes in a row: the threshold (zscore {} over the last {} accepted steps) may be wrong rather "
          "than the data; raise nan_capture.spike.zscore, or replay the capture to see\n",
          spike_.max_consecutive, spike_.zscore, spike_.window);
    if (e.partial) {
      if (t.is_global_zero())
        fmt::print(stderr,
                   "nan_capture: {} at step {} (epoch {}, batch {}); the update was not applied. The step began before "
                   "this run resumed from a checkpoint taken mid-way through gradient accumulation, so it cannot be "
                   "captured\n{}",
                   text, step, e.loop.epoch, e.loop.batch_in_epoch, why);
      stopped_ = true;
      t.request_stop(kExitNaN);
      return;
    }
    record["description"] = text;
    const std::string dir = write_capture(t, e, false, false, record);
    captures_.push_back(dir);
    if (t.is_global_zero())
      fmt::print(stderr,
                 "nan_capture: {} at step {} (epoch {}, batch {}); the update was not applied.\n{}"
                 "nan_capture: capture written to {}\nnan_capture: replay it with: strobe replay {} --diagnose\n",
                 text, step, e.loop.epoch, e.loop.batch_in_epoch, why, dir, dir);
    stopped_ = true;
    t.request_stop(kExitNaN);
  }

  std::string write_capture(TrainerView& t, const RingEntry& e, bool loss_bad, bool grads_bad,
                            const nlohmann::json& spike = nullptr) {
    if (dirpath_.empty())
      throw std::runtime_error("nan_capture: no run directory to write the capture to (set the callback's dirpath)");
    // The checkpoint of the failing step's start (loop_state.h: StepStart): its loop counters, RNG
    // and buffers (later forwards may have moved BatchNorm statistics), through the connector that
    // writes every checkpoint, so a capture has the layout of any checkpoint.
    StepStart start;
    start.loop = e.loop;
    start.rng = e.rng;
    auto& pipe = t.step_access().step_pipeline();
    if (!e.record.buffers_before.empty()) {
      auto bufs = pipe.unflatten_buffers(e.record.buffers_before);
      for (size_t i = 0; i < bufs.size(); ++i)
        if (bufs[i].defined()) start.buffers[pipe.buffer_names()[i]] = bufs[i];
    }
    auto d = t.step_access().make_checkpoint_at(start);
    capture::put_batches(d, e.batches);

    nlohmann::json losses = nlohmann::json::array();
    for (const auto& l : e.record.losses) {
      auto host = l.to(torch::kCPU);
      losses.push_back({{"value", fmt::format("{:.9g}", host.to(torch::kDouble).item<double>())}, {"bits", capture::tensor_bits(host)},
                        {"dtype", std::string(c10::toString(host.scalar_type()))}});
    }
    const auto grads = nonfinite_grads(e);
    nlohmann::json info = {{"step", step_number(e)},
                           {"global_step", e.loop.global_step},
                           {"epoch", e.loop.epoch},
                           {"batch_in_epoch", e.loop.batch_in_epoch},
                           {"batch_indices", e.batch_indices},
                           {"micro_batches", e.batches.size()},
                           {"device", t.device().str()},
                           {"precision", to_string(t.config().precision)},
                           {"loss_nonfinite", loss_bad},
                           {"grads_nonfinite", grads_bad},
                           {"grads_checked", e.record.grad_norms.defined()},
                           {"nonfinite_grads", grads},
                           {"losses", losses},
                           {"dataset_indices", dataset_indices(e)},
                           {"previous_dataset_indices", previous_indices_},
                           {"kind", spike.is_null() ? "nonfinite" : "spike"},
                           {"rank", t.rank()},
                           {"world_size", t.world_size()},
                           {"action", stop_ ? "stop" : "skip_step"}};
    if (!spike.is_null()) info["spike"] = spike;
    d.blobs[checkpoint_keys::kCapture] = info.dump(2);

    // Data parallel: every rank writes its own capture (its micro-batches and RNG, the weights every
    // rank shares): rank 0 to <dir>/step_<N>, rank r to <dir>/rank<r>/step_<N>.
    const fs::path base = t.is_global_zero() ? fs::path(dirpath_) : fs::path(dirpath_) / fmt::format("rank{}", t.rank());
    // A capture never replaces another (a run sharing this dirpath that failed at the same step, an
    // earlier attempt of this run): mkdir claims the first free name, step_<N>, then step_<N>.1, ...;
    // the finished capture is renamed onto that empty directory. The temporary is this process's own.
    fs::create_directories(base);
    fs::path final_dir = base / fmt::format("step_{}", step_number(e));
    for (int k = 1; ::mkdir(final_dir.c_str(), 0777) != 0; ++k) {
      if (errno != EEXIST || k > 10000)
        throw checkpoint::WriteError(fmt::format("{}: cannot create the capture directory ({})", final_dir.string(), std::strerror(errno)));
      final_dir = base / fmt::format("step_{}.{}", step_number(e), k);
    }
    const fs::path tmp = base / fmt::format(".step_{}.tmp.{}", step_number(e), ::getpid());
    checkpoint::remove_tree(tmp.string());
    fs::create_directories(tmp);
    try {
      checkpoint::save_checkpoint_file((tmp / capture::kCheckpointFile).string(), d);
      checkpoint::write_file_atomic((tmp / "config.yaml").string(), CheckpointView(d, final_dir.string()).require_config());
      std::ostringstream s;
      const std::string what = !spike.is_null()             ? spike.value("description", std::string("spike"))
                               : loss_bad && grads_bad ? "Non-finite loss and gradients"
                               : loss_bad              ? "Non-finite loss"
                                                       : "Non-finite gradients";
      s << fmt::format("{} at step {} (epoch {}, batch {} of the epoch), {} micro-batch(es), device {}, precision {}.\n", what, step_number(e),
                       e.loop.epoch, e.loop.batch_in_epoch, e.batches.size(), t.device().str(), to_string(t.config().precision));
      for (size_t i = 0; i < losses.size(); ++i) s << fmt::format("loss of micro-batch {}: {}\n", i, losses[i]["value"].get<std::string>());
      if (!grads.empty()) {
        s << fmt::format("{} non-finite gradient(s):", grads.size());
        for (size_t i = 0; i < grads.size() && i < 20; ++i) s << ' ' << grads[i];
        s << (grads.size() > 20 ? " ...\n" : "\n");
      }
      s << "The weights, buffers and optimizer state are from before this step (its update was skipped on the device).\n"
        << fmt::format("Replay: strobe replay {}\n", final_dir.string());
      checkpoint::write_file_atomic((tmp / "summary.txt").string(), s.str());
    } catch (...) {
      checkpoint::remove_tree(tmp.string());  // a capture is whole or absent
      ::rmdir(final_dir.c_str());
      throw;
    }
    fs::rename(tmp, final_dir);  // onto the empty directory this capture claimed
    return final_dir.string();
  }

  bool check_grads_, check_loss_, stop_;
  int64_t max_skips_, keep_last_;
  std::string dirpath_;
  std::deque<RingEntry> ring_;
  int64_t skips_ = 0;
  std::vector<int64_t> skipped_steps_;
  std::vector<std::string> captures_;
  bool stopped_ = false;
  SpikeGuard spike_;
  int64_t spikes_ = 0;
  std::vector<std::vector<int64_t>> previous_indices_;  // the dataset indices of the last resolved step
};

std::shared_ptr<Callback> make_nan_capture(config::Section& cfg) {
  std::string check = cfg.get_choice("check", "both", {"both", "grads", "loss"});
  std::string action = cfg.get_choice("action", "stop", {"stop", "skip_step"});
  int64_t max_skips = cfg.get_int("max_skips", 0, 0);
  int64_t keep_last = cfg.get_int("keep_last", 4, 1, 1024);
  std::string dirpath = cfg.get_string("dirpath", "");
  SpikeGuard spike;
  if (cfg.has("spike")) {
    // Present (a mapping, `{}` for the defaults): spikes are caught.
    auto sc = cfg.child("spike");
    const std::string metric = sc.get_choice("metric", "loss", {"loss", "grad_norm", "both"});
    spike.loss = metric != "grad_norm";
    spike.grad_norm = metric != "loss";
    spike.zscore = sc.get_double("zscore", 6.0, 1e-6, 1e6);
    spike.window = sc.get_int("window", 128, 2, 1 << 20);
    spike.warmup = sc.get_int("warmup", 64, 2, 1 << 20);
    if (spike.warmup > spike.window)
      sc.fail("warmup", fmt::format("must not exceed spike.window ({}): the window holds the warm-up steps", spike.window));
    spike.stop = sc.get_choice("action", "stop", {"stop", "skip_step"}) == "stop";
    spike.max_consecutive = sc.get_int("max_consecutive", 5, 1, 1 << 20);
    sc.finish();
  }
  cfg.finish();
  return std::make_shared<NaNCapture>(check != "loss", check != "grads", action == "stop", max_skips, keep_last, dirpath, spike);
}

STROBE_REGISTER(callback_registry(), "nan_capture", make_nan_capture);

}  // namespace
}  // namespace strobe
