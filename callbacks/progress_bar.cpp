// progress_bar: epoch, batch, it/s, ETA and the latest loss. On a terminal one line redrawn in place
// (at most 10 times a second), fitted to the terminal's width (a line that wraps cannot be redrawn
// and floods the screen): the bar shrinks, then the least useful fields go. Otherwise one plain line
// per log interval. Epochs are 0-based everywhere (bar, validation line, metrics.csv, checkpoint
// names), as in Lightning: "epoch 0 (1 of 2)" is the first of two. Values come from the trainer's
// delivered metrics, so drawing never waits for the device: the loss reaches the host every
// log_every_n_steps, and the bar says which step it is from ("loss 2.463 @ step 20"). The ETA is to
// the end of the run, by whichever limit ends it first (max_epochs, max_steps, max_time).
#include <sys/ioctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/callback.h"
#include "strobe/core/trainer_view.h"

namespace strobe {
namespace {

// Columns of the terminal on stdout; $COLUMNS when stdout is not one (or reports 0); else 80.
int terminal_width() {
  struct winsize ws {};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  if (const char* c = std::getenv("COLUMNS")) {
    const int n = std::atoi(c);
    if (n > 0) return n;
  }
  return 80;
}

std::string hms(double s) {
  if (!std::isfinite(s) || s < 0) return "--:--";
  auto t = static_cast<int64_t>(s);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60) : fmt::format("{:02}:{:02}", t / 60, t % 60);
}

class ProgressBar : public Callback {
 public:
  explicit ProgressBar(bool tty) : tty_(tty) {}
  std::string name() const override { return "progress_bar"; }

  void on_train_epoch_start(TrainerView&, Module&) override { epoch_start_ = Clock::now(), batches_ = 0; }
  void on_train_start(TrainerView&, Module&) override { train_start_ = epoch_start_ = Clock::now(), batches_ = 0; }

  // Console output is rank 0's (data parallel: the other ranks stay quiet).
  void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    if (!t.is_global_zero()) return;
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

  void on_validation_end(TrainerView& t, Module&) override {
    if (t.sanity_checking() || !t.is_global_zero()) return;
    std::string vals;
    for (const auto& kv : t.metrics())
      if (kv.first.rfind("val/", 0) == 0) vals += fmt::format(" {}={:.4f}", kv.first, kv.second);
    if (tty_) fmt::print("\n");
    fmt::print("validation at epoch {} step {}:{}\n", t.state().epoch, t.state().global_step, vals);
    std::fflush(stdout);
  }

  void on_train_end(TrainerView& t, Module&) override {
    if (tty_ && t.is_global_zero()) fmt::print("\n");
    std::fflush(stdout);
  }

  // strobe predict: the batches done and their rate (redrawn on a terminal, a line per
  // log_every_n_steps batches otherwise).
  void on_predict_start(TrainerView&, Module&) override { epoch_start_ = Clock::now(), batches_ = 0; }
  void on_predict_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    ++batches_;
    const auto now = Clock::now();
    if (tty_ ? now - last_draw_ < std::chrono::milliseconds(100) : batches_ % t.config().log_every_n_steps != 0) return;
    last_draw_ = now;
    const double secs = std::chrono::duration<double>(now - epoch_start_).count();
    const double rate = secs > 0 ? batches_ / secs : 0.0;
    if (tty_)
      fmt::print("\rPredict {} batches {:.2f}it/s\x1b[K", batches_, rate);
    else
      fmt::print("predict batch {} {:.2f}it/s\n", batches_, rate);
    std::fflush(stdout);
  }
  void on_predict_end(TrainerView&, Module&) override {
    if (tty_ && batches_ > 0) fmt::print("\n");
    std::fflush(stdout);
  }

 private:
  using Clock = std::chrono::steady_clock;
  void draw(TrainerView& t, Clock::time_point now) {
    const auto& s = t.state();
    const auto& c = t.config();
    const int64_t n = t.num_training_batches();
    double secs = std::chrono::duration<double>(now - epoch_start_).count();
    double rate = secs > 0 ? batches_ / secs : 0.0;
    const double eta = seconds_left(t, rate, std::chrono::duration<double>(now - train_start_).count());
    std::string loss;
    for (const char* key : {"train/loss", "train/loss_step"}) {
      auto it = t.metrics().find(key);
      if (it != t.metrics().end()) {
        const auto at = t.metric_step(key);
        loss = fmt::format(" loss {:.4g}{}", it->second, at ? fmt::format(" @ step {}", *at) : "");
        break;
      }
    }
    std::string epochs = c.max_epochs >= 0 ? fmt::format("{} ({} of {})", s.epoch, s.epoch + 1, c.max_epochs)
                                           : fmt::format("{}", s.epoch);
    if (tty_) {
      fmt::print("\r{}\x1b[K", fit_line(epochs, s.batch_in_epoch, n, s.global_step, rate, hms(eta), loss, terminal_width()));
    } else {
      fmt::print("epoch {} batch {}/{} step {} {:.2f}it/s ETA {}{}\n", epochs, s.batch_in_epoch, n, s.global_step, rate,
                 hms(eta), loss);
    }
    std::fflush(stdout);
  }

  // Seconds to the end of the run at `rate` batches a second: the fewest batches any limit leaves
  // (the epochs left, the optimizer steps left times the accumulation), or max_time's rest; -1 when
  // neither is known.
  static double seconds_left(TrainerView& t, double rate, double secs_since_start) {
    const auto& s = t.state();
    const auto& c = t.config();
    const int64_t n = t.num_training_batches();
    int64_t batches = -1;
    auto take = [&](int64_t v) { batches = batches < 0 ? v : std::min(batches, v); };
    if (c.max_epochs >= 0) take(std::max<int64_t>(0, n - s.batch_in_epoch) + std::max<int64_t>(0, c.max_epochs - 1 - s.epoch) * n);
    if (c.max_steps >= 0)
      take(std::max<int64_t>(0, (c.max_steps - s.global_step) * c.accumulate_grad_batches - t.accumulated_batches()));
    double eta = batches >= 0 && rate > 0 ? static_cast<double>(batches) / rate : -1;
    if (c.max_time_s) {
      const double rest = std::max(0.0, *c.max_time_s - s.elapsed_s - secs_since_start);
      eta = eta < 0 ? rest : std::min(eta, rest);
    }
    return eta;
  }

  // The redrawn line in at most width - 1 columns (the last column would wrap on some terminals).
  static std::string fit_line(const std::string& epochs, int64_t batch, int64_t n, int64_t step, double rate,
                              const std::string& eta, const std::string& loss, int width) {
    const size_t room = static_cast<size_t>(std::max(width - 1, 10));
    // Fields by importance; the bar takes what is left, 24 columns at most, none under 6.
    std::vector<std::string> fields = {fmt::format("epoch {}", epochs), fmt::format("{}/{}", batch, n), loss.empty() ? "" : loss.substr(1),
                                       fmt::format("ETA {}", eta), fmt::format("{:.2f}it/s", rate),
                                       fmt::format("step {}", step)};
    auto join = [&](size_t count, int bar) {
      std::string out = fields[0];
      if (bar > 0) {
        const int filled = n > 0 ? static_cast<int>(bar * batch / n) : 0;
        out += " [" + std::string(filled, '=') + std::string(bar - filled, ' ') + "]";
      }
      for (size_t i = 1; i < count; ++i)
        if (!fields[i].empty()) out += " " + fields[i];
      return out;
    };
    for (size_t count = fields.size(); count >= 1; --count) {
      const size_t bare = join(count, 0).size();
      if (bare + 3 + 6 <= room) return join(count, static_cast<int>(std::min<size_t>(24, room - bare - 3)));
      if (bare <= room && count <= 3) return join(count, 0);
    }
    return join(1, 0).substr(0, room);
  }

  bool tty_;
  Clock::time_point train_start_, epoch_start_, last_draw_;
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
