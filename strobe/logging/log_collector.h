// LogCollector: the trainer's LogSink. Values logged by a module stay on the device; at each log
// interval (and at the end of each validation/test epoch) they are stacked into one small tensor and
// copied asynchronously into a slot of a pinned-memory ring, with an event recorded after the copy.
// Host consumers (CSV, TensorBoard, progress bar, monitors) see a row only once its event has
// completed, so the step path never waits for the device. Epoch-level values are device-side means
// weighted by the batch size (a host number known at collate time: no sync).
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "strobe/checkpoint/stateful.h"
#include "strobe/logging/log_sink.h"
#include "strobe/logging/metric_row.h"

namespace strobe::checkpoint {
struct CheckpointData;
}

namespace strobe::logging {

class LogCollector : public LogSink, public Stateful {
 public:
  explicit LogCollector(torch::Device device, int64_t ring_slots = 16);
  ~LogCollector() override;

  void log(const std::string& name, const torch::Tensor& value, const LogOptions& options, int64_t batch_size) override;
  void set_training(bool training) { training_ = training; }

  // After an optimizer step: when `emit`, this step's on_step values go to the host (async).
  void end_step(int64_t step, int64_t epoch, bool emit);
  // End of an epoch of the current stage: queues the epoch means; `wait` delivers them before returning
  // (epoch-end decisions: early stopping, top-k checkpoints, reduce-on-plateau).
  void end_epoch(int64_t step, int64_t epoch, bool wait);
  void poll();   // deliver every row whose copy has completed, in order
  void drain();  // wait for all pending copies, deliver them, flush consumers
  void discard_epoch();  // forget on_epoch accumulations (sanity check)
  // Host values (learning rates, throughput) go to the consumers at once.
  void emit_host(int64_t step, int64_t epoch, const std::vector<std::pair<std::string, double>>& values);

  void add_consumer(MetricConsumer* c) { consumers_.push_back(c); }
  void remove_consumer(MetricConsumer* c) { consumers_.erase(std::remove(consumers_.begin(), consumers_.end(), c), consumers_.end()); }
  // Data parallel: `sum` all-reduces a device tensor in place (Strategy::reduce_sum). Epoch means
  // become means over every rank's values (weighted by batch size), identical on every rank; a
  // checkpoint holds the summed accumulators, which only the `primary` rank (0) restores (the others
  // restart theirs at zero) so the next epoch mean counts every value once. Every rank must log the
  // same names in an epoch.
  void set_epoch_reducer(std::function<void(torch::Tensor&)> sum, bool primary) {
    reduce_sum_ = std::move(sum), primary_ = primary;
  }
  const std::map<std::string, double>& latest() const { return latest_; }
  // The step of the row each latest() value came in.
  const std::map<std::string, int64_t>& latest_steps() const { return latest_step_; }
  // The state connector's entry: epoch accumulators and a step's partial (micro-batch) values, so a
  // checkpoint taken mid-epoch resumes with the same epoch means.
  void save_state(checkpoint::CheckpointData& out) const;
  // While set, save_state keeps this process's own epoch sums (no all-reduce): a checkpoint one
  // process writes alone, when its peers may be in another collective or gone.
  void set_local_save(bool local) { local_save_ = local; }
  void load_state(const checkpoint::CheckpointData& in);
  // Stateful (the checkpoint's `logger` entry): save_state / load_state.
  void save(checkpoint::CheckpointData& out, const StepStart*) override { save_state(out); }
  void load(const checkpoint::CheckpointData& in) override { load_state(in); }

 private:
  struct Slot;
  void enqueue(int64_t step, int64_t epoch, std::vector<std::string> names, std::vector<torch::Tensor> values);
  void deliver(Slot& s);
  bool ready(const Slot& s) const;

  torch::Device device_;
  bool training_ = true;
  // Under gradient accumulation every micro-batch's value counts: a step logs their mean.
  struct StepAcc {
    torch::Tensor sum;
    int64_t n = 0;
  };
  std::map<std::string, StepAcc> step_values_;
  struct EpochAcc {
    torch::Tensor sum;
    double count = 0;
  };
  std::map<std::string, EpochAcc> epoch_values_;
  // Sums and counts of every rank (data parallel); the accumulators themselves stay local.
  std::pair<std::vector<torch::Tensor>, torch::Tensor> reduced_epoch_values() const;
  std::function<void(torch::Tensor&)> reduce_sum_;
  bool local_save_ = false;
  bool primary_ = true;
  std::vector<std::unique_ptr<Slot>> ring_;
  std::deque<Slot*> pending_;
  size_t next_slot_ = 0;
  std::vector<MetricConsumer*> consumers_;
  std::map<std::string, double> latest_;
  std::map<std::string, int64_t> latest_step_;
};

}  // namespace strobe::logging
