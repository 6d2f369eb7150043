#include "strobe/distributed/strategy.h"
#include "strobe/distributed/ddp_strategy.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/control_collectives/StoreCollectives.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/distributed/nccl_backend.h"
#include "strobe/metrics/collection.h"
#include "strobe/metrics/metric.h"

namespace strobe::distributed {

namespace detail {

CpuBackendFactory& cpu_backend_factory() {
  static CpuBackendFactory f;
  return f;
}

}  // namespace detail

namespace {

class SingleDeviceStrategy final : public Strategy {
 public:
  explicit SingleDeviceStrategy(torch::Device device) : device_(device) {}
  int64_t rank() const override { return 0; }
  int64_t world_size() const override { return 1; }
  int64_t local_rank() const override { return 0; }
  const torch::Device& device() const override { return device_; }
  void setup_model(torch::nn::Module&) override {}
  void setup_grad_sync(torch::nn::Module&) override {}
  void set_grad_sync(bool enabled) override { sync_ = enabled; }
  bool grad_sync() const override { return sync_; }
  void pre_backward() override {}
  void finish_grad_sync() override {}
  torch::Tensor reduce_max(torch::Tensor flag, CollectiveKind) override { return flag; }
  torch::Tensor reduce_sum(torch::Tensor values, CollectiveKind) override { return values; }
  bool any(bool flag) override { return flag; }
  std::string broadcast_string(const std::string& v) override { return v; }
  std::vector<std::string> gather_strings(const std::string& mine) override { return {mine}; }
  void barrier(const std::string&) override {}
  void sync_metrics(metrics::MetricCollection&) override {}
  void sync_metric(metrics::Metric&) override {}
  c10d::ProcessGroup* process_group() override { return nullptr; }
  void abort(const std::string&) override {}
  void shutdown() override {}

 private:
  torch::Device device_;
  bool sync_ = true;
};

}  // namespace


Strategy::OptimizerSetup Strategy::setup_optimizer(std::vector<ShardedParam> trainable, const BuildOptimizer& build) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& t : trainable) named.emplace_back(t.name, t.master);
  OptimizerSetup out;
  if (sharding()) {
    // ZeRO-2: the optimizer updates this rank's shards of the fp32 values, under the same names (zero2.h).
    out.shards = shard_parameters(std::move(trainable));
    for (size_t i = 0; i < named.size(); ++i) named[i].second = out.shards->shards()[i];
  }
  out.optimizer = build(named);
  return out;
}

void set_cpu_backend_factory(CpuBackendFactory factory) { detail::cpu_backend_factory() = std::move(factory); }

torch::Device resolve_device(const std::string& spec, const LaunchEnv& env) {
  const bool multi = env.world_size > 1;
  auto cuda_count = [] { return static_cast<int64_t>(torch::cuda::device_count()); };
  auto local_gpu = [&](const std::string& why) {
    if (env.local_rank >= cuda_count())
      throw config::ConfigError(fmt::format("trainer.device: '{}' {}: local rank {} needs cuda:{} but only {} CUDA device(s) are visible",
                                            spec, why, env.local_rank, env.local_rank, cuda_count()));
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  };
  if (spec == "auto") {
    if (!torch::cuda::is_available()) return torch::Device(torch::kCPU);
    return local_gpu("(each process takes the GPU of its local rank)");
  }
  std::optional<torch::Device> d;
  try {
    d = torch::Device(spec);
  } catch (const std::exception&) {
    throw config::ConfigError(fmt::format("trainer.device: '{}' is not a device (auto | cpu | cuda | cuda:N)", spec));
  }
  if (!d->is_cuda()) return *d;
  if (!torch::cuda::is_available())
    throw config::ConfigError(fmt::format("trainer.device: '{}' requested but no CUDA device is visible", spec));
  if (multi) {
    if (d->has_index())
      throw config::ConfigError(fmt::format(
          "trainer.device: '{}' names one GPU but this is rank {} of {}: use auto or cuda (each process takes cuda:LOCAL_RANK)",
          spec, env.rank, env.world_size));
    return local_gpu("(each process takes the GPU of its local rank)");
  }
  int64_t idx = d->has_index() ? d->index() : 0;
  if (idx >= cuda_count())
    throw config::ConfigError(fmt::format("trainer.device: '{}' requested but only {} CUDA device(s) are visible", spec, cuda_count()));
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(idx));
}

std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options) {
  return make_strategy(options, launch_env_from_process());
}

std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options, const LaunchEnv& env) {
  torch::Device device = resolve_device(options.device, env);
  if (env.world_size <= 1) return std::make_unique<SingleDeviceStrategy>(device);
  if (options.timeout.count() <= 0) throw config::ConfigError("trainer.dist_timeout: must be positive");
  if (device.is_cpu() && !detail::cpu_backend_factory())
    throw config::ConfigError(fmt::format(
        "trainer.device: '{}' with {} processes: multi-process training runs on CUDA (NCCL); this libtorch offers no CPU "
        "process group (see docs/DISTRIBUTED.md)",
        options.device, env.world_size));
  if (!device.is_cuda() && !device.is_cpu())
    throw config::ConfigError(fmt::format("trainer.device: '{}' is not supported with {} processes", options.device, env.world_size));
  if (device.is_cuda()) set_current_cuda_device(device.index());
  return detail::make_ddp_strategy(options, env, device);
}

}  // namespace strobe::distributed
