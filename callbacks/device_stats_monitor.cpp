// device_stats_monitor (Lightning's DeviceStatsMonitor): every `every_n_steps` optimizer steps
// (default trainer.log_every_n_steps) the CUDA caching allocator's allocated, reserved and peak
// allocated memory of the run's device (GiB; peak since the process started) and the process's
// resident memory on the host. Every value is a host-side counter: reading them never waits for the
// device.
#include <optional>

#include <torch/torch.h>

#include "strobe/core/callback.h"
#include "strobe/core/throughput.h"
#include "strobe/core/trainer_view.h"

namespace strobe {
namespace {

class DeviceStatsMonitor : public Callback {
 public:
  explicit DeviceStatsMonitor(std::optional<int64_t> every_n_steps) : every_n_steps_(every_n_steps) {}
  std::string name() const override { return "device_stats_monitor"; }

  void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    const int64_t step = t.state().global_step;
    const int64_t n = every_n_steps_.value_or(t.config().log_every_n_steps);
    if (t.accumulated_batches() != 0 || step == logged_step_ || (step % n != 0 && step != 1)) return;
    logged_step_ = step;
    constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
    std::vector<std::pair<std::string, double>> values;
    if (auto m = device_memory(t.device())) {
      values.emplace_back("device_stats/allocated_gib", m->allocated / kGiB);
      values.emplace_back("device_stats/reserved_gib", m->reserved / kGiB);
      values.emplace_back("device_stats/peak_allocated_gib", m->peak_allocated / kGiB);
    }
    values.emplace_back("device_stats/host_rss_gib", resident_memory_bytes() / kGiB);
    t.log_host(values);
  }

 private:
  std::optional<int64_t> every_n_steps_;
  int64_t logged_step_ = -1;
};

std::shared_ptr<Callback> make_device_stats_monitor(config::Section& cfg) {
  std::optional<int64_t> every;
  if (!cfg.is_null("every_n_steps")) every = cfg.get_int("every_n_steps", 1, 1);
  else cfg.accept("every_n_steps");
  cfg.finish();
  return std::make_shared<DeviceStatsMonitor>(every);
}

STROBE_REGISTER(callback_registry(), "device_stats_monitor", make_device_stats_monitor);

}  // namespace
}  // namespace strobe
