// progress_bar: epoch, batch, it/s, ETA and the latest loss. On a terminal one line redrawn in place
// (at most 10 times a second); otherwise one plain line per log interval. Values come from the
// trainer's delivered metrics, so drawing never waits for the device.
#include <unistd.h>

#include <chrono>

#include <fmt/format.h>
#include <torch/torch.h>

#include "framework/core/callback.h"
#include "framework/core/trainer.h"

namespace strobe {
namespace {

std::string hms(double s) {
  if (!std::isfinite(s) || s < 0) return "--:--";
  auto t = static_cast<int64_t>(s);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60) : fmt::format("{:02}:{:02}", t / 60, t % 60);
}

class ProgressBar : public Callback {
 public:
  explicit ProgressBar(bool tty) : tty_(tty) {}
  std::string name() const override { return "progress_bar"; }

  void on_train_epoch_start(Trainer&, Module&) override { epoch_start_ = Clock::now(), batches_ = 0; }
  void on_train_start(Trainer&, Module&) override { epoch_start_ = Clock::now(), batches_ = 0; }

  void on_train_batch_end(Trainer& t, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    ++batches_;
    auto now = Clock::now();
    const auto step = t.state().global_step;
    if (tty_) {
      if (now - last_draw_ < std::chrono::milliseconds(100) && t.state().batch_in_epoch < t.num_training_batches()) return;
    } else if (step % t.config().log_every_n_steps != 0 || step == printed_step_) {
      return;
    }
    last_draw_ = now, printed_step_ = step;
    draw(t, now);
  }

  void on_validation_end(Trainer& t, Module&) override {
    if (t.sanity_checking()) return;
    std::string vals;
    for (const auto& kv : t.metrics())
      if (kv.first.rfind("val/", 0) == 0) vals += fmt::format(" {}={:.4f}", kv.first, kv.second);
    if (tty_) fmt::print("\n");
    fmt::print("validation at epoch {} step {}:{}\n", t.state().epoch, t.state().global_step, vals);
    std::fflush(stdout);
  }

  void on_train_end(Trainer&, Module&) override {
    if (tty_) fmt::print("\n");
    std::fflush(stdout);
  }

 private:
  using Clock = std::chrono::steady_clock;
  void draw(Trainer& t, Clock::time_point now) {
    const auto& s = t.state();
    const int64_t n = t.num_training_batches();
    double secs = std::chrono::duration<double>(now - epoch_start_).count();
    double rate = secs > 0 ? batches_ / secs : 0.0;
    double eta = rate > 0 ? (n - s.batch_in_epoch) / rate : -1;
    std::string loss;
    for (const char* key : {"train/loss", "train/loss_step"}) {
      auto it = t.metrics().find(key);
      if (it != t.metrics().end()) {
        loss = fmt::format(" loss={:.4f}", it->second);
        break;
      }
    }
    std::string epochs = t.config().max_epochs >= 0 ? fmt::format("{}/{}", s.epoch + 1, t.config().max_epochs)
                                                    : fmt::format("{}", s.epoch + 1);
    if (tty_) {
      const int width = 24;
      int filled = n > 0 ? static_cast<int>(width * s.batch_in_epoch / n) : 0;
      fmt::print("\rEpoch {} [{}{}] {}/{} step {} {:.2f}it/s ETA {}{}\x1b[K", epochs, std::string(filled, '='),
                 std::string(width - filled, ' '), s.batch_in_epoch, n, s.global_step, rate, hms(eta), loss);
    } else {
      fmt::print("epoch {} batch {}/{} step {} {:.2f}it/s ETA {}{}\n", epochs, s.batch_in_epoch, n, s.global_step, rate,
                 hms(eta), loss);
    }
    std::fflush(stdout);
  }

  bool tty_;
  Clock::time_point epoch_start_, last_draw_;
  int64_t batches_ = 0, printed_step_ = -1;
};

std::shared_ptr<Callback> make_progress_bar(config::Section& cfg) {
  std::string mode = cfg.get_choice("mode", "auto", {"auto", "tty", "plain"});
  cfg.finish();
  bool tty = mode == "tty" || (mode == "auto" && ::isatty(STDOUT_FILENO));
  return std::make_shared<ProgressBar>(tty);
}

STROBE_REGISTER(callback_registry(), "progress_bar", make_progress_bar);

}  // namespace
}  // namespace strobe
