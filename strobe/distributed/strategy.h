// Strategy: everything that differs between training on one device and on many processes. The
// trainer and the callbacks ask the strategy; nothing else looks at ranks.
//
// Contract (both implementations):
// - resolve_device(spec): "auto" is cuda:LOCAL_RANK when CUDA is visible, else cpu; "cuda" is
//   cuda:LOCAL_RANK; with more than one process an explicit "cuda:i" is refused (each process owns
//   the GPU of its local rank). Bad specs throw config::ConfigError (exit 2).
// - setup_model(net): every rank starts from rank 0's parameters and buffers (broadcast) and the
//   parameter shapes are checked to agree across ranks; gradient hooks are installed.
// - One optimizer step = micro-batches; for each: set_grad_sync(last micro-batch of the step), the
//   forward and the loss, pre_backward(), backward(), then after the last one finish_grad_sync().
//   After finish_grad_sync() every parameter's .grad is the mean over ranks of the per-rank
//   gradients accumulated over the step's micro-batches (identical on every rank), and buffers
//   (e.g. BatchNorm statistics) are rank 0's (broadcast after the backward, as the graph may have
//   saved them). The all-reduces run in buckets launched by
//   autograd hooks while backward is still running (c10d::Reducer, the engine of PyTorch's DDP);
//   micro-batches with sync off all-reduce nothing.
// - reduce_max(flag): in-place MAX over ranks of a device tensor; on CUDA it only orders the current
//   stream after the collective (no host synchronization).
// - any(flag) / broadcast_string / barrier: host decisions through the rendezvous store; they block
//   the calling thread, never the GPU. Use them at epoch ends and other rare points. If one cannot
//   complete (a peer missing past options.timeout, the store's host gone) the process ends with the
//   failure line below.
// - sync_metrics / unsync_metrics: all-reduce metric states (metrics::Metric::sync) / restore them.
// - Failure: a rank that dies or stops heartbeating, a rank that calls abort(), or a rendezvous that
//   does not complete ends every process with one line on stderr naming the rank and the cause,
//   within options.timeout (exit status 1). shutdown() is the orderly end: after it no failure of a
//   peer is reported.
// SingleDeviceStrategy implements all of this as no-ops around one device.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>

#include "strobe/distributed/collective_record.h"
#include "strobe/distributed/launch_env.h"
#include "strobe/distributed/fsdp.h"
#include "strobe/distributed/zero2.h"

namespace c10d {
class ProcessGroup;
class Backend;
class Store;
}  // namespace c10d
namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace strobe::metrics {
class Metric;
class MetricCollection;
}  // namespace strobe::metrics

namespace strobe::distributed {

// A failure of the distributed job (rendezvous timeout, a dead peer, a failed collective).
struct DistributedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct StrategyOptions {
  std::string device = "auto";                    // trainer.device
  std::chrono::milliseconds timeout{std::chrono::seconds(600)};  // trainer.dist_timeout
  int64_t bucket_cap_mb = 25;                     // DDP's default bucket size
  bool broadcast_buffers = true;                  // rank 0's buffers win on every synced step
  bool zero2 = false;                             // trainer.strategy: zero2 (zero2.h), and under fsdp
  bool fsdp = false;                              // trainer.strategy: fsdp (fsdp.h): zero2's shards, the parameters sharded too
};

class Strategy {
 public:
  virtual ~Strategy() = default;

  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  virtual int64_t local_rank() const = 0;
  bool is_global_zero() const { return rank() == 0; }
  virtual const torch::Device& device() const = 0;

  virtual void setup_model(torch::nn::Module& net) = 0;
  // The gradient synchronisation rebuilt over the parameters of `net` that now require gradients
  // (optimizer.param_groups.freeze: the unfreeze); every rank calls it at the same step.
  virtual void setup_grad_sync(torch::nn::Module& net) = 0;
  virtual void set_grad_sync(bool enabled) = 0;
  virtual bool grad_sync() const = 0;
  virtual void pre_backward() = 0;
  virtual void finish_grad_sync() = 0;

  // `kind` says what the collective is for, in the rank's record of its collectives
  // (collective_record.h).
  virtual torch::Tensor reduce_max(torch::Tensor device_flag, CollectiveKind kind) = 0;
  // In-place SUM over ranks of a device tensor (epoch-mean accumulators); no host synchronization.
  virtual torch::Tensor reduce_sum(torch::Tensor values, CollectiveKind kind) = 0;
  virtual bool any(bool host_flag) = 0;
  virtual std::string broadcast_string(const std::string& value_on_rank0) = 0;
  // Every rank's `mine`, in rank order, on rank 0 (empty elsewhere): per-rank RNG states into
  // rank 0's checkpoint.
  virtual std::vector<std::string> gather_strings(const std::string& mine) = 0;
  virtual void barrier(const std::string& what) = 0;

  virtual void sync_metrics(metrics::MetricCollection& metrics) = 0;
  virtual void sync_metric(metrics::Metric& metric) = 0;

  // nullptr for a single device.
  virtual c10d::ProcessGroup* process_group() = 0;

  // Data parallel: this rank's record of the collectives it issued (collective_record.h); null for
  // a single device.
  virtual const CollectiveRecord* collectives() const { return nullptr; }
  // Rank 0 of a data-parallel job: every rank's latest collective as its heartbeats published it
  // (rank 0's own from its record), in rank order; empty elsewhere.
  virtual std::vector<CollectiveEntry> published_collectives() const { return {}; }
  // Where each rank writes its record of collectives when the job hangs or its collectives diverge
  // (the run directory; docs/DISTRIBUTED.md, "When a run hangs").
  virtual void set_record_dir(const std::string& dir) { (void)dir; }

  // trainer.strategy: zero2 with several processes. sharding() says so from the start;
  // shard_parameters() makes the shards once the trainable parameters' fp32 values are known (the
  // trainer's fit setup, before the optimizer, which then updates the shards; null under ddp and
  // for one process): from then on pre_backward / finish_grad_sync reduce-scatter into them
  // instead of all-reducing, and every parameter's gradient lives in its shard (zero2.h).
  virtual bool sharding() const { return false; }
  virtual Zero2Shards* shard_parameters(std::vector<ShardedParam> params) {
    (void)params;
    return nullptr;
  }

  // trainer.strategy fsdp with several processes (fsdp.h), after setup_optimizer: the model's
  // parameters cut into units. Each of `blocks` is a unit, attached so that the models' run_block
  // gathers it around the block; the parameters of `net` in no block are one more unit, kept
  // gathered. The last block (in the forward's order) is not freed after its forward, which the
  // backward starts with; an nn::Embedding block is not gathered for its backward. The optimizer's
  // shards are bound to the units (Zero2Shards::bind_units). Returns the units in model order (the
  // kept one first); empty under ddp and zero2 and for one process.
  virtual std::vector<FsdpUnit*> shard_model(torch::nn::Module& net, std::vector<FsdpBlock> blocks, bool reshard_after_forward) {
    (void)net, (void)blocks, (void)reshard_after_forward;
    return {};
  }

  // Builds the training optimizer (Lightning's Strategy.setup_optimizers): `build` makes it over
  // named fp32 tensors (the optimizer: section's groups, the frozen ones among them); which tensors
  // is this strategy's choice: every trainable parameter's fp32 value, or under zero2 this rank's
  // shards of them (shard_parameters, under the same names). `trainable`: the model's trainable
  // parameters in order, each with its fp32 value. The shards are returned too (null: none).
  struct OptimizerSetup {
    std::shared_ptr<torch::optim::Optimizer> optimizer;
    Zero2Shards* shards = nullptr;
  };
  using BuildOptimizer =
      std::function<std::shared_ptr<torch::optim::Optimizer>(const std::vector<std::pair<std::string, torch::Tensor>>& named)>;
  OptimizerSetup setup_optimizer(std::vector<ShardedParam> trainable, const BuildOptimizer& build);

  // This rank cannot go on: tell the others (they end with `why`), then return; the caller exits.
  virtual void abort(const std::string& why) = 0;
  // The same for the exception ending this rank (the Trainer's fit, unwinding): abort(error.what()).
  // Data parallel: a failed collective (any c10d error, e.g. NCCL's "remote process exited or there
  // was a network error") ends the process here instead, with one line naming the rank whose death
  // caused it when the health monitor finds one within a few heartbeats, else the error
  // (docs/DISTRIBUTED.md, "Failure behaviour").
  virtual void abort_on_error(const std::exception& error) { abort(error.what()); }
  // The orderly end of the job on this rank (waits for every rank to reach it).
  virtual void shutdown() = 0;
};

// Builds the strategy the environment asks for (launch_env_from_process()): a single-device one
// for one process, else a DDP strategy after the rendezvous (TCPStore at MASTER_ADDR:MASTER_PORT,
// NCCL on CUDA). Throws config::ConfigError on a bad environment or device, DistributedError when
// the rendezvous fails or times out.
std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options);
std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options, const LaunchEnv& env);

// The device the spec names for this process (see the contract above); no rendezvous.
torch::Device resolve_device(const std::string& spec, const LaunchEnv& env);

// CPU collectives. The libtorch wheel compiles ProcessGroupGloo but ships none of gloo's headers, so
// Strobe offers no CPU process group to users; multi-process training on CPU is refused unless a
// backend factory is installed here. Only Strobe's own tests install one (a labelled test double
// under tests/distributed/). See docs/DISTRIBUTED.md.
using CpuBackendFactory = std::function<c10::intrusive_ptr<c10d::Backend>(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout)>;
void set_cpu_backend_factory(CpuBackendFactory factory);

}  // namespace strobe::distributed
