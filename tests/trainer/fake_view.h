// A TrainerView with no Trainer behind it: what a callback or a loop sees, set by the test.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/module.h"
#include "strobe/core/step_pipeline.h"
#include "strobe/core/trainer_view.h"

namespace strobe::testing {

class ViewModule : public Module {
 public:
  ViewModule() : net_(torch::nn::Linear(2, 1)) {}
  torch::nn::Module& net() override { return *net_; }
  torch::Tensor training_step(const Batch&, int64_t) override { return {}; }
  torch::nn::Linear net_;
};

class FakeView : public TrainerView, public StepAccess {
 public:
  const config::TrainerConfig& config() const override { return cfg; }
  const std::string& run_dir() const override { return dir; }
  const torch::Device& device() const override { return dev; }
  const TrainerState& state() const override { return live ? *live : loop; }
  int64_t accumulated_batches() const override { return 0; }
  int64_t num_training_batches() const override { return n_batches; }
  int64_t estimated_stepping_batches() const override { return 100; }
  bool sanity_checking() const override { return false; }
  double last_input_wait_s() const override { return 0; }
  bool is_global_zero() const override { return true; }
  int64_t rank() const override { return 0; }
  int64_t world_size() const override { return 1; }
  std::optional<double> rank0_value(std::optional<double> v) override { return v; }
  const std::map<std::string, double>& metrics() const override { return latest; }
  std::optional<int64_t> metric_step(const std::string& name) const override {
    if (!latest.count(name)) return std::nullopt;
    auto it = latest_step.find(name);
    return it == latest_step.end() ? state().global_step : it->second;
  }
  void drain_metrics() override {}
  void log_host(const std::vector<std::pair<std::string, double>>& values) override {
    for (const auto& v : values) logged.push_back(v);
  }
  void log_host_at(int64_t, int64_t, const std::vector<std::pair<std::string, double>>& values) override { log_host(values); }
  torch::optim::Optimizer* optimizer() override { return opt.get(); }
  const std::vector<std::string>& param_group_names() const override { return group_names; }
  std::vector<std::string> group_names;
  std::vector<std::pair<std::string, torch::Tensor>> weights() override { throw std::logic_error("no model in this view"); }
  LRScheduler* scheduler() override { return nullptr; }
  DataModule& datamodule() override { throw std::logic_error("no data in this view"); }
  int64_t forward_over_training_data(int64_t) override { throw std::logic_error("no data in this view"); }
  void request_stop(int code) override {
    stops.push_back(code);
    if (on_stop) on_stop(code);
  }
  bool should_stop() const override { return !stops.empty(); }
  void save_checkpoint(const std::string&) override { throw std::logic_error("not here"); }
  checkpoint::CheckpointData make_checkpoint() override { throw std::logic_error("not here"); }
  StepAccess& step_access() override { return *this; }
  void arm_step_guard(const StepGuard& g) override { guards.push_back(g); }
  const StepPipelineView& step_pipeline() const override { throw std::logic_error("not here"); }
  checkpoint::CheckpointData make_checkpoint_at(const StepStart&) override { throw std::logic_error("not here"); }

  config::TrainerConfig cfg;
  std::string dir;
  torch::Device dev{torch::kCPU};
  TrainerState loop;
  const TrainerState* live = nullptr;  // a loop's counters instead of `loop`
  std::map<std::string, double> latest;
  std::map<std::string, int64_t> latest_step;  // a metric's step when not the current one
  int64_t n_batches = 10;                      // training batches per epoch
  std::vector<std::pair<std::string, double>> logged;
  std::shared_ptr<torch::optim::Optimizer> opt;
  std::vector<int> stops;
  std::function<void(int)> on_stop;  // forwards a request (to the loop under test)
  std::vector<StepGuard> guards;
};

}  // namespace strobe::testing
