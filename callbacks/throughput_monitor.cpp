// throughput_monitor (Lightning's ThroughputMonitor, without its per-update synchronize): samples/s,
// real tokens/s (the token collates' num_tokens, never padded positions), the model's FLOP/s and its
// utilisation of the device's dense peak at the run's precision (strobe/core/throughput.h), logged
// every `every_n_steps` optimizer steps (default trainer.log_every_n_steps).
//
// Timing without a host sync: a window of steps opens with a timing event recorded on the device's
// stream before its first step and closes with one after its last step's work is queued; the
// window's values are logged (to its last step's row) once the closing event has completed, which
// the host learns by asking (a query, never a wait), as the metrics are delivered. The time between
// the events is the device timeline: a device idle waiting for the loader counts, so the rates are
// what a user gets. Validation closes the open window (it is not training time); the end of
// training waits for the last window. On the CPU the clock is the host's steady clock.
// Data parallel: rank 0's window, samples and tokens times the world size (every rank steps alike);
// FLOP/s and utilisation are per device.
#include <cmath>
#include <chrono>
#include <cstdio>
#include <deque>
#include <optional>

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/callback.h"
#include "strobe/core/model.h"
#include "strobe/core/module.h"
#include "strobe/core/throughput.h"
#include "strobe/core/trainer_view.h"

namespace strobe {
namespace {

// A point on the device's timeline: a timing event on its current stream (CUDA), else the host clock.
struct TimelineMark {
  std::unique_ptr<c10::Event> event;
  std::chrono::steady_clock::time_point host;

  static TimelineMark now(const torch::Device& device) {
    TimelineMark m;
    if (device.is_cuda()) {
      m.event = std::make_unique<c10::Event>(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
      m.event->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device));
    } else {
      m.host = std::chrono::steady_clock::now();
    }
    return m;
  }
  bool ready() const { return !event || event->query(); }
  // Seconds from `start` to this mark; both ready.
  double seconds_since(const TimelineMark& start) const {
    if (event) return start.event->elapsedTime(*event) / 1e3;
    return std::chrono::duration<double>(host - start.host).count();
  }
};

// Steps between two marks and what they processed; logged to `log_step`'s row.
struct ThroughputWindow {
  TimelineMark start, end;
  int64_t steps = 0, log_step = 0, log_epoch = 0;
  double samples = 0, tokens = 0, flops = 0;
  bool flops_known = true;  // every batch's FLOPs were declared
};

class ThroughputMonitor : public Callback {
 public:
  ThroughputMonitor(std::optional<int64_t> every_n_steps, std::optional<double> peak_tflops)
      : every_n_steps_(every_n_steps), peak_override_(peak_tflops) {}
  std::string name() const override { return "throughput_monitor"; }

  void on_fit_start(TrainerView& t, Module& module) override {
    model_ = dynamic_cast<Model*>(&module.net());
    const std::string dtype = matmul_dtype(t.config().precision);
    const std::string device = device_name(t.device());
    if (peak_override_) {
      peak_ = *peak_override_ * 1e12;
      peak_note_ = fmt::format("peak {:g} TFLOP/s (callbacks' peak_tflops)", *peak_override_);
    } else if (auto p = dense_peak(device, dtype)) {
      peak_ = p->flops;
      peak_note_ = fmt::format("peak {:g} TFLOP/s ({} dense {})", p->flops / 1e12, p->device, dtype);
    } else {
      peak_ = 0;
      peak_note_ = fmt::format("no dense {} peak is known for '{}', so no utilisation (throughput/mfu) is logged "
                               "(set the callback's peak_tflops to have it)", dtype, device);
    }
    if (t.is_global_zero()) {
      fmt::print(stderr, "strobe: throughput_monitor: {}\n", peak_note_);
      std::fflush(stderr);
    }
  }

  void on_train_batch_start(TrainerView& t, Module&, const Batch& batch, int64_t) override {
    poll(t, /*wait=*/false);
    if (!open_) {
      if (t.accumulated_batches() != 0) return;  // windows start at a step's first micro-batch
      open_.emplace();
      open_->start = TimelineMark::now(t.device());
    }
    open_->samples += static_cast<double>(batch_samples(batch));
    open_->tokens += static_cast<double>(batch_tokens(batch));
    const double f = model_ ? model_->training_flops(batch) : 0;
    if (!(std::isfinite(f) && f > 0)) open_->flops_known = false;  // undeclared, or a declaration of inf, NaN or < 0
    open_->flops += f;
  }

  void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    if (!open_ || t.accumulated_batches() != 0) return;
    ++open_->steps;
    const int64_t n = every_n_steps_.value_or(t.config().log_every_n_steps);
    if (t.state().global_step % n == 0) close(t);
  }

  void on_validation_start(TrainerView& t, Module&) override {
    if (open_ && open_->steps > 0 && t.accumulated_batches() == 0) close(t);
  }

  void on_train_end(TrainerView& t, Module&) override {
    if (open_ && open_->steps > 0) close(t);
    open_.reset();
    poll(t, /*wait=*/true);
  }

 private:
  void close(TrainerView& t) {
    open_->end = TimelineMark::now(t.device());
    open_->log_step = t.state().global_step;
    open_->log_epoch = t.state().epoch;
    closed_.push_back(std::move(*open_));
    open_.reset();
  }

  void poll(TrainerView& t, bool wait) {
    while (!closed_.empty() && (wait || closed_.front().end.ready())) {
      ThroughputWindow& w = closed_.front();
      if (w.end.event) w.end.event->synchronize();  // ready already, unless waiting at the end
      const double secs = w.end.seconds_since(w.start);
      if (secs > 0) {
        const double world = static_cast<double>(t.world_size());
        std::vector<std::pair<std::string, double>> values = {
            {"throughput/samples_per_s", w.samples * world / secs},
            {"throughput/step_ms", secs * 1e3 / static_cast<double>(w.steps)}};
        if (w.tokens > 0) values.emplace_back("throughput/tokens_per_s", w.tokens * world / secs);
        if (w.flops_known && w.flops > 0) {
          values.emplace_back("throughput/device_tflop_per_s", w.flops / secs / 1e12);
          if (peak_ > 0) values.emplace_back("throughput/mfu", w.flops / secs / peak_);
        }
        t.log_host_at(w.log_step, w.log_epoch, values);
      }
      closed_.pop_front();
    }
  }

  std::optional<int64_t> every_n_steps_;
  std::optional<double> peak_override_;
  double peak_ = 0;
  std::string peak_note_;
  Model* model_ = nullptr;
  std::optional<ThroughputWindow> open_;
  std::deque<ThroughputWindow> closed_;
};

std::shared_ptr<Callback> make_throughput_monitor(config::Section& cfg) {
  std::optional<int64_t> every;
  if (!cfg.is_null("every_n_steps")) every = cfg.get_int("every_n_steps", 1, 1);
  else cfg.accept("every_n_steps");
  std::optional<double> peak;
  if (!cfg.is_null("peak_tflops")) peak = cfg.get_double("peak_tflops", 0.0, 1e-6, 1e9);
  else cfg.accept("peak_tflops");
  cfg.finish();
  return std::make_shared<ThroughputMonitor>(every, peak);
}

STROBE_REGISTER(callback_registry(), "throughput_monitor", make_throughput_monitor);

}  // namespace
}  // namespace strobe
