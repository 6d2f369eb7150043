// The step suite: full training steps of the seed workloads, run by the real Trainer built the way
// `strobe fit` builds a run (config::Document + --set overrides -> build_run -> Trainer::fit), with
// a timing callback. A step's time is the interval between the marks at the start of consecutive
// optimizer steps on the device timeline (CUDA events on the compute stream; steady clock on the
// CPU), so loader stalls that idle the device count. Input-wait is the host time the training loop
// spent blocked on the loader's next batch inside that interval (Trainer::last_input_wait_s());
// compute is step minus input-wait.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>

#include <fmt/format.h>
#include <torch/torch.h>

#include "bench/lib/bench.h"
#include "strobe/config/config.h"
#include "strobe/core/callback.h"
#include "strobe/core/model.h"
#include "strobe/core/module.h"
#include "strobe/core/source_tree.h"
#include "strobe/core/throughput.h"
#include "strobe/core/trainer.h"
#include "runner/experiment_builder.h"

namespace strobe::bench {
namespace {

struct Workload {
  std::string name, config;
  std::vector<std::string> sets;
};

// The seed's GPU-sized workloads (issue 14's table) and their CPU twins under configs/cpu/.
std::vector<Workload> default_workloads(bool cuda) {
  const std::string dir = cuda ? "configs/" : "configs/cpu/";
  return {
      {"vit_l16", dir + "vit_l16.yaml", {}},
      {"face_detector_giou", dir + "face_detector_giou.yaml", {}},
      // issue 14's row: cross-entropy, no callbacks, SGD + momentum (as pytorch_baselines.py resnet50)
      {"resnet50", dir + "resnet50_nan.yaml",
       {"task.loss=cross_entropy", "callbacks=[]", "optimizer.name=sgd", "optimizer.lr=0.001", "optimizer.momentum=0.9"}},
      {"lm_pack", dir + "decoder_lm_varlen.yaml", {"data.collate=pack"}},
      {"lm_pad_to_max", dir + "decoder_lm_varlen.yaml", {"data.collate=pad_to_max"}},
      {"lm_pad_to_longest", dir + "decoder_lm_varlen.yaml", {"data.collate=pad_to_longest"}},
      // Llama-3.2-1B's shape, full 2048-token sequences (as pytorch_baselines.py llama)
      {"llama_1b", dir + "llama_1b.yaml", {}},
  };
}

std::string find_config(const std::string& path, std::string source_dir) {
  namespace fs = std::filesystem;
  if (source_dir.empty()) source_dir = strobe::source_tree();
  std::error_code ec;
  if (fs::exists(path, ec) || source_dir.empty() || fs::path(path).is_absolute()) return path;
  const fs::path alt = fs::path(source_dir) / path;
  return fs::exists(alt, ec) ? alt.string() : path;
}

// Marks the start of every optimizer step and the end of the last one; sums the loader waits.
class StepTimer : public Callback {
 public:
  explicit StepTimer(int64_t last_step) : last_step_(last_step) {}
  std::string name() const override { return "bench_step_timer"; }
  void setup(TrainerView& t, Module&, Stage) override { marks_.emplace(t.device()); }
  void on_train_batch_start(TrainerView& t, Module& m, const Batch& batch, int64_t) override {
    // The first batch's start: everything before it is setup (the model's device copies, the
    // optimizer state, zero2's shards), and the allocator's peak so far is setup's.
    if (!setup_peak_bytes_) setup_peak_bytes_ = peak_memory_bytes(t.device());
    wait_s_ += t.last_input_wait_s();
    // Per training batch: its real tokens (the collates' num_tokens, as throughput_monitor counts
    // them) and the model's declared training FLOPs (Model::training_flops; 0 when undeclared).
    tokens_.push_back(batch_tokens(batch));
    const auto* model = dynamic_cast<const Model*>(&m.net());
    flops_.push_back(model ? model->training_flops(batch) : 0);
    if (t.accumulated_batches() != 0) return;
    // Between steps the activations are gone: what is allocated is the model state (weights,
    // optimizer state, kept gradient buffers).
    if (auto mem = device_memory(t.device())) state_bytes_ = mem->allocated;
    marks_->record();
    wait_at_mark_.push_back(wait_s_);
    if (batch_size_ == 0) batch_size_ = t.datamodule().train_loader() ? t.datamodule().train_loader()->options().batch_size : 0;
  }
  void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    if (t.accumulated_batches() == 0 && t.state().global_step == last_step_) {
      marks_->record();
      wait_at_mark_.push_back(wait_s_);
    }
  }
  std::optional<Marks> marks_;  // on the run's device, from setup
  std::vector<double> wait_at_mark_;
  int64_t last_step_, batch_size_ = 0;
  std::vector<int64_t> tokens_;  // per training batch
  std::vector<double> flops_;    // per training batch
  double wait_s_ = 0;
  double state_bytes_ = 0;  // allocated at the start of the latest step (CUDA)
  std::optional<double> setup_peak_bytes_;  // the peak allocated before the first batch (CUDA)
};


nlohmann::json run_workload(const Workload& w, const SuiteOptions& o, int64_t warmup, int64_t steps) {
  const std::string path = find_config(w.config, o.source_dir);
  std::error_code ec;
  if (o.config.empty() && !std::filesystem::exists(path, ec))
    throw BenchUsageError(fmt::format("workload {}: its config {} is one of the repository's configs/ and is found from the "
                                      "repository root (or the source tree this strobe was built from); run strobe bench "
                                      "from the repository root, or time a config of yours with -c FILE",
                                      w.name, w.config));
  auto doc = config::Document::load_file(path);
  // No validation, checkpoints, logs, model summary or progress bar: only training steps are timed. The caller's
  // --set come last and win.
  std::vector<std::string> sets = {fmt::format("trainer.max_steps={}", warmup + steps),
                                   "trainer.max_epochs=-1",
                                   "trainer.num_sanity_val_steps=0",
                                   "trainer.limit_val_batches=0",
                                   "trainer.enable_progress_bar=false",
                                   "trainer.enable_model_summary=false",
                                   "trainer.enable_checkpointing=false",
                                   "logger.csv=false",
                                   "logger.tensorboard=false"};
  sets.insert(sets.end(), w.sets.begin(), w.sets.end());
  sets.insert(sets.end(), o.sets.begin(), o.sets.end());
  for (const auto& s : sets) doc.apply_override(s);
  RunOptions ro;
  ro.stage = Stage::Fit;
  ro.create_run_dir = false;
  auto timer = std::make_shared<StepTimer>(warmup + steps);
  ro.extra_callbacks.push_back(timer);
  // The cap and the peak's start are set before the trainer moves anything to the GPU: they hold for
  // all the run allocates, building the model's device copies included.
  ro.on_device = [&](const torch::Device& d) {
    if (o.memory_limit_gib > 0) limit_device_memory(d, o.memory_limit_gib);
    reset_peak_memory(d);
  };
  auto run = build_run(doc, ro);
  const torch::Device device = run->trainer->view().device();
  fmt::print(stderr, "strobe bench: step {}: {} warm-up + {} timed steps on {}{}\n", w.name, warmup, steps, device.str(),
             o.memory_limit_gib > 0 ? fmt::format(" (capped at {:g} GiB)", o.memory_limit_gib) : "");
  const int rc = run->trainer->fit();
  if (rc != 0) throw std::runtime_error(fmt::format("step suite: {} stopped with exit status {}", w.name, rc));
  const std::vector<double> ms = timer->marks_->intervals_ms();
  const auto& wait = timer->wait_at_mark_;
  // Interval i runs from the mark of step i+1 to the next mark; the first `warmup` are dropped.
  std::vector<double> step_ms, wait_ms, compute_ms;
  for (size_t i = static_cast<size_t>(std::max<int64_t>(warmup, 0)); i < ms.size(); ++i) {
    const double wi = (wait[i + 1] - wait[i]) * 1e3;
    step_ms.push_back(ms[i]);
    wait_ms.push_back(wi);
    compute_ms.push_back(std::max(0.0, ms[i] - wi));
  }
  const Stats s = summarize(step_ms);
  nlohmann::json j = {{"name", w.name},
                      {"config", w.config},
                      {"overrides", w.sets},
                      {"device", device.str()},
                      {"precision", to_string(run->experiment.trainer.precision)},
                      {"batch_size", timer->batch_size_},
                      {"warmup_steps", warmup},
                      {"steps", static_cast<int64_t>(step_ms.size())},
                      {"ms", to_json(s)},
                      {"input_wait_ms", to_json(summarize(wait_ms))},
                      {"compute_ms", to_json(summarize(compute_ms))},
                      {"step_ms_all", step_ms},
                      {"input_wait_ms_all", wait_ms}};
  if (timer->batch_size_ > 0 && s.median > 0) j["samples_per_s"] = static_cast<double>(timer->batch_size_) * 1e3 / s.median;
  // Over the timed steps (one batch each: the step suite does not accumulate), at the mean step
  // (what a user gets): real tokens/s for token workloads, and the model's FLOP/s with its
  // utilisation of the device's dense peak at the run's precision, as throughput_monitor reports them
  // (strobe/core/throughput.h). GPU: the peak memory allocated.
  const auto& tokens = timer->tokens_;
  const auto& flops = timer->flops_;
  const size_t first = static_cast<size_t>(warmup), end = first + step_ms.size();
  if (s.mean > 0 && tokens.size() >= end && flops.size() >= end) {
    double timed_tokens = 0, timed_flops = 0;
    bool declared = true;
    for (size_t i = first; i < end; ++i) {
      timed_tokens += static_cast<double>(tokens[i]);
      timed_flops += flops[i];
      declared &= std::isfinite(flops[i]) && flops[i] > 0;  // a declaration of inf, NaN or < 0 is none
    }
    const double n = static_cast<double>(step_ms.size());
    if (timed_tokens > 0) {
      j["tokens_per_step"] = timed_tokens / n;
      j["tokens_per_s"] = timed_tokens / n * 1e3 / s.mean;
    }
    if (declared) {
      j["model_tflop_per_step"] = timed_flops / n / 1e12;
      const std::string dtype = matmul_dtype(run->experiment.trainer.precision);
      if (const auto peak = dense_peak(device_name(device), dtype)) {
        j["mfu"] = timed_flops / n * 1e3 / s.mean / peak->flops;
        j["peak_tflops"] = fmt::format("{:g} ({} dense {})", peak->flops / 1e12, peak->device, dtype);
      }
    }
  }
  if (device.is_cuda()) {
    j["peak_memory_gib"] = peak_memory_bytes(device) / double(1 << 30);
    if (timer->setup_peak_bytes_) j["setup_peak_memory_gib"] = *timer->setup_peak_bytes_ / double(1 << 30);
    j["state_memory_gib"] = timer->state_bytes_ / double(1 << 30);
    // What the GPU itself must hold: the allocator's largest reservation, and the device's memory in
    // use at the end (the reservation plus the CUDA context, NCCL's buffers, ...). A GPU of
    // G GiB holds the run when peak_reserved_gib + (device_used_gib - the reservation then) <= G.
    j["peak_reserved_gib"] = peak_reserved_bytes(device) / double(1 << 30);
    j["device_used_gib"] = device_used_bytes(device) / double(1 << 30);
    if (const auto mem = device_memory(device)) j["reserved_gib"] = mem->reserved / double(1 << 30);
    if (o.memory_limit_gib > 0) j["memory_limit_gib"] = o.memory_limit_gib;
  }
  // Several processes (torchrun): this rank's numbers; the job's tokens/s is world_size times
  // tokens_per_s when the ranks step together (they do: every step ends in a collective).
  j["world_size"] = run->trainer->view().world_size();
  j["rank"] = run->trainer->view().rank();
  return j;
}

}  // namespace

void check_step_options(const SuiteOptions& o) {
  for (const auto& name : o.workloads) {
    std::string known;
    bool found = false;
    for (const auto& w : default_workloads(o.cuda)) {
      known += (known.empty() ? "" : ", ") + w.name;
      found |= w.name == name;
    }
    if (!found) throw BenchUsageError(fmt::format("--workload: unknown workload '{}' (workloads: {})", name, known));
  }
  if (!o.workloads.empty() && !o.config.empty()) throw BenchUsageError("--workload and --config exclude each other");
}

nlohmann::json step_suite(const SuiteOptions& o) {
  const int64_t warmup = o.warmup >= 0 ? o.warmup : o.cuda ? 30 : 3;
  const int64_t steps = o.steps > 0 ? o.steps : o.cuda ? 50 : 10;
  std::vector<Workload> ws;
  if (!o.config.empty()) {
    ws.push_back({std::filesystem::path(o.config).stem().string(), o.config, {}});
  } else {
    for (auto& w : default_workloads(o.cuda))
      if (o.workloads.empty() || std::find(o.workloads.begin(), o.workloads.end(), w.name) != o.workloads.end())
        ws.push_back(w);
  }
  nlohmann::json out = {{"status", "ok"}, {"workloads", nlohmann::json::array()}};
  for (const auto& w : ws) out["workloads"].push_back(run_workload(w, o, warmup, steps));
  return out;
}

}  // namespace strobe::bench
