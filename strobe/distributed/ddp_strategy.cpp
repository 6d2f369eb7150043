#include "strobe/distributed/ddp_strategy.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <set>
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
#include "strobe/distributed/health_monitor.h"
#include "strobe/distributed/nccl_backend.h"
#include "strobe/metrics/collection.h"
#include "strobe/metrics/metric.h"

namespace strobe::distributed {

namespace {

using namespace detail;

class DDPStrategy;
std::atomic<DDPStrategy*> g_live_strategy{nullptr};
std::terminate_handler g_previous_terminate = nullptr;
[[noreturn]] void on_terminate();

class DDPStrategy final : public Strategy {
 public:
  DDPStrategy(const StrategyOptions& options, const LaunchEnv& env, torch::Device device)
      : options_(options), env_(env), device_(device) {
    address_ = fmt::format("{}:{}", env.master_addr, env.master_port);
    rendezvous();
    // NCCL's watchdog thread ends the process (std::terminate) on a collective's error, often before
    // the main thread has seen it: the handler gives that error the same one line.
    g_live_strategy = this;
    g_previous_terminate = std::set_terminate(&on_terminate);
  }
  ~DDPStrategy() override {
    // Destroyed without shutdown(): an exception is unwinding this rank. Tell the others.
    if (!shut_down_) abort("ended without finishing (an error on this rank)");
    reducer_.reset();
    zero2_.reset();
    units_.clear();
    if (monitor_) monitor_->stop();
    std::set_terminate(g_previous_terminate);
    g_live_strategy = nullptr;
  }

  int64_t rank() const override { return env_.rank; }
  int64_t world_size() const override { return env_.world_size; }
  int64_t local_rank() const override { return env_.local_rank; }
  const torch::Device& device() const override { return device_; }

  void setup_model(torch::nn::Module& net) override {
    torch::NoGradGuard ng;
    std::vector<torch::Tensor> params, state;
    std::unordered_map<size_t, std::string> names;
    buffers_.clear();
    for (auto& p : net.named_parameters()) {
      state.push_back(p.value());
      if (!p.value().requires_grad()) continue;
      names[params.size()] = p.key();
      params.push_back(p.value());
    }
    for (auto& b : net.named_buffers()) {
      state.push_back(b.value());
      buffers_.push_back(b.value());
    }
    buffers_bytes_ = bytes_of(buffers_);
    TORCH_CHECK(!params.empty(), "the model has no trainable parameters");
    for (auto& t : state)
      TORCH_CHECK(t.device() == device_, "model tensor on ", t.device(), " but the strategy's device is ", device_);
    int64_t seq = record_.issue(CollectiveKind::kParamCheck, static_cast<int64_t>(params.size()) * 8);
    c10d::verify_params_across_processes(pg_, params, std::nullopt);
    record_.returned(seq);
    seq = record_.issue(CollectiveKind::kSetupBroadcast, bytes_of(state));
    c10d::broadcast_coalesced(pg_, state, kBroadcastBytes, 0);
    record_.returned(seq);
    if (options_.zero2) return;  // the shards come with the optimizer (shard_parameters)
    build_reducer(params, std::move(names));
  }

  bool sharding() const override { return options_.zero2; }

  Zero2Shards* shard_parameters(std::vector<ShardedParam> params) override {
    if (!options_.zero2) return nullptr;
    TORCH_CHECK(!zero2_, "Strategy::shard_parameters called twice");
    zero2_ = std::make_unique<Zero2Shards>(pg_, rank(), world_size(), std::move(params), options_.bucket_cap_mb * 1024 * 1024,
                                           &record_);
    return zero2_.get();
  }

  std::vector<FsdpUnit*> shard_model(torch::nn::Module& net, std::vector<FsdpBlock> blocks, bool reshard_after_forward) override {
    if (!options_.fsdp) return {};
    TORCH_CHECK(zero2_, "Strategy::shard_model before the optimizer's shards (setup_optimizer)");
    TORCH_CHECK(units_.empty(), "Strategy::shard_model called twice");
    TORCH_CHECK(!blocks.empty(), "fsdp: no blocks to shard");
    group_ = std::make_shared<FsdpUnitGroup>();
    std::set<const void*> claimed;
    for (const auto& b : blocks)
      for (const auto& p : b.params) claimed.insert(p.second.unsafeGetTensorImpl());
    std::vector<std::pair<std::string, torch::Tensor>> rest;
    for (const auto& p : net.named_parameters())
      if (!claimed.count(p.value().unsafeGetTensorImpl())) rest.emplace_back(p.key(), p.value());
    std::vector<FsdpUnit*> out;
    if (!rest.empty()) {
      FsdpUnitOptions o;
      o.keep_gathered = true;
      units_.push_back(std::make_unique<FsdpUnit>(pg_, rank(), world_size(), "root", std::move(rest), o,
                                                  group_, &record_));
      out.push_back(units_.back().get());
    }
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto& [module, named] = blocks[i];
      FsdpUnitOptions o;
      // The last unit of the forward (the head, or the last block) is kept for the backward, which
      // starts with it: freeing it would only gather it again at once.
      o.reshard_after_forward = reshard_after_forward && i + 1 < blocks.size();
      // An embedding's backward reads the indices and the row count, not the weight: not gathered.
      o.backward_gathers = module->as<torch::nn::EmbeddingImpl>() == nullptr;
      const std::string name = named.front().first.substr(0, named.front().first.rfind('.'));
      units_.push_back(std::make_unique<FsdpUnit>(pg_, rank(), world_size(), name, std::move(named), o, group_, &record_));
      attach_unit(*module, units_.back().get());
      out.push_back(units_.back().get());
    }
    zero2_->bind_units(out);
    return out;
  }

  void setup_grad_sync(torch::nn::Module& net) override {
    std::vector<torch::Tensor> params;
    std::unordered_map<size_t, std::string> names;
    for (auto& p : net.named_parameters()) {
      if (!p.value().requires_grad()) continue;
      names[params.size()] = p.key();
      params.push_back(p.value());
    }
    TORCH_CHECK(!params.empty(), "the model has no trainable parameters");
    reducer_.reset();  // its autograd hooks go with it
    const int64_t seq = record_.issue(CollectiveKind::kParamCheck, static_cast<int64_t>(params.size()) * 8);
    c10d::verify_params_across_processes(pg_, params, std::nullopt);
    record_.returned(seq);
    if (options_.zero2) {
      if (zero2_) zero2_->install_hooks();  // the newly trainable parameters' gradients are sharded too
      return;
    }
    build_reducer(params, std::move(names));
  }

  void build_reducer(const std::vector<torch::Tensor>& params, std::unordered_map<size_t, std::string> names) {
    // As torch's DDP without unused parameters: one bucket for the first iteration, rebuilt from the
    // order in which gradients became ready, with bucket_cap_mb buckets (a 1 MiB first one).
    std::vector<bool> sparse(params.size(), false);
    auto [indices, limits] = c10d::compute_bucket_assignment_by_size(params, {std::numeric_limits<size_t>::max()}, sparse);
    (void)limits;
    std::reverse(indices.begin(), indices.end());
    grad_bytes_ = bytes_of(params);
    reducer_ = std::make_unique<c10d::Reducer>(params, indices, pg_, sparse, options_.bucket_cap_mb * 1024 * 1024,
                                               /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/false,
                                               names, /*first_bucket_bytes_cap=*/1024 * 1024,
                                               /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
                                               std::vector<int64_t>{});
  }

  void set_grad_sync(bool enabled) override { sync_ = enabled; }
  bool grad_sync() const override { return sync_; }

  void pre_backward() override {
    if (options_.zero2) {
      TORCH_CHECK(zero2_, "Strategy::pre_backward under zero2 before shard_parameters");
      if (!sync_) return;  // gradients accumulate locally until the step's last micro-batch
      zero2_->prepare_for_backward();
      pending_ = true;
      return;
    }
    TORCH_CHECK(reducer_, "Strategy::pre_backward before setup_model");
    if (!sync_) return;  // the reducer's hooks stay idle: gradients accumulate locally
    reducer_->prepare_for_forward();
    reducer_->rebuild_buckets();
    reducer_->prepare_for_backward({});
    // The Reducer issues the bucket all-reduces inside this backward: one entry for all of them.
    grad_seq_ = record_.issue(CollectiveKind::kGradientAllReduce, grad_bytes_);
    pending_ = true;
  }

  void finish_grad_sync() override {
    // The reducer finalized inside backward (an autograd engine callback waits for every bucket and
    // writes the averaged gradients back). Buffers follow rank 0 after the backward: broadcasting
    // them before it would bump the version of tensors the graph saved (BatchNorm's statistics).
    if (!pending_) return;
    pending_ = false;
    if (grad_seq_) record_.returned(std::exchange(grad_seq_, 0));  // the backward that ran its buckets is done
    if (zero2_) zero2_->finish();
    if (options_.broadcast_buffers && !buffers_.empty()) {
      torch::NoGradGuard ng;
      const int64_t seq = record_.issue(CollectiveKind::kBufferBroadcast, buffers_bytes_);
      c10d::broadcast_coalesced(pg_, buffers_, kBroadcastBytes, 0);
      record_.returned(seq);
    }
  }

  torch::Tensor reduce_max(torch::Tensor flag, CollectiveKind kind) override {
    return allreduce_in_place(flag, c10d::ReduceOp::MAX, kind);
  }
  torch::Tensor reduce_sum(torch::Tensor values, CollectiveKind kind) override {
    return allreduce_in_place(values, c10d::ReduceOp::SUM, kind);
  }

  bool any(bool flag) override {
    return checked("any", CollectiveKind::kHostAny, 8,
                   [&] { return collectives_->allSum(next_key("any"), flag ? 1 : 0, options_.timeout) > 0; });
  }

  std::string broadcast_string(const std::string& v) override {
    return checked("broadcast", CollectiveKind::kHostBroadcast, static_cast<int64_t>(v.size()), [&] {
      auto key = next_key("bcast");
      if (rank() == 0) {
        collectives_->broadcastSend(key, std::vector<uint8_t>(v.begin(), v.end()), options_.timeout);
        return v;
      }
      auto got = collectives_->broadcastRecv(key, options_.timeout);
      return std::string(got.begin(), got.end());
    });
  }

  std::vector<std::string> gather_strings(const std::string& mine) override {
    if (record_.skips(CollectiveKind::kHostGather, rank())) return {};  // tests only
    return checked("gather", CollectiveKind::kHostGather, static_cast<int64_t>(mine.size()), [&] {
      auto key = next_key("gather");
      std::vector<uint8_t> bytes(mine.begin(), mine.end());
      std::vector<std::string> all;
      if (rank() != 0) {
        collectives_->gatherSend(key, bytes, options_.timeout);
        return all;
      }
      for (auto& b : collectives_->gatherRecv(key, bytes, options_.timeout)) all.emplace_back(b.begin(), b.end());
      return all;
    });
  }

  void barrier(const std::string& what) override {
    checked("barrier (" + what + ")", CollectiveKind::kHostBarrier, 0, [&] {
      collectives_->barrier(next_key("barrier"), options_.timeout, true);
      return 0;
    });
  }

  void sync_metrics(metrics::MetricCollection& m) override {
    if (record_.skips(CollectiveKind::kMetricSync, rank())) return;  // tests only
    const int64_t seq = record_.issue(CollectiveKind::kMetricSync, 0);
    m.sync(*pg_);
    record_.returned(seq);
  }
  void sync_metric(metrics::Metric& m) override {
    if (record_.skips(CollectiveKind::kMetricSync, rank())) return;  // tests only
    const int64_t seq = record_.issue(CollectiveKind::kMetricSync, 0);
    m.sync(*pg_);
    record_.returned(seq);
  }
  void set_record_dir(const std::string& dir) override {
    if (monitor_) monitor_->set_record_dir(dir);
  }
  c10d::ProcessGroup* process_group() override { return pg_.get(); }
  const CollectiveRecord* collectives() const override { return &record_; }
  std::vector<CollectiveEntry> published_collectives() const override {
    if (rank() != 0 || !monitor_) return {};
    auto all = monitor_->published();
    all[0] = record_.latest();
    return all;
  }

  void abort(const std::string& why) override {
    if (shut_down_ || aborted_) return;
    aborted_ = true;
    if (monitor_) monitor_->stop();  // this rank reports its own failure; no second message
    try {
      auto msg = fmt::format("rank {} failed: {}", rank(), one_line(why));
      health_store_->set("abort", std::vector<uint8_t>(msg.begin(), msg.end()));
      if (monitor_) wait_until_the_others_read_the_reason(*health_store_, rank(), world_size(), 10 * monitor_->interval());
    } catch (const std::exception&) {
      // The store is gone too: the other ranks notice that on their own.
    }
  }

  void abort_on_error(const std::exception& error) override {
    if (is_collective_error(error)) collective_failed(short_error(error));
    abort(error.what());
  }

  // A collective failed on this rank: see abort_on_error (strategy.h). Ends the process, unless the
  // job had already finished in order.
  void collective_failed(const std::string& why) {
    // The main thread and NCCL's watchdog may both get here: the first one ends the process.
    static std::mutex once;
    once.lock();
    if (shut_down_) {  // the job had finished in order: nothing is left to explain
      once.unlock();
      return;
    }
    if (monitor_ && !aborted_) monitor_->expect_a_verdict();  // may end the process, naming a dead rank
    abort(why);  // returns once the other ranks have read the reason
    fail_now(rank(), world_size(), "a collective failed on this rank: " + one_line(why));
  }

  void shutdown() override {
    if (shut_down_) return;
    shut_down_ = true;
    health_store_->set("done/" + std::to_string(rank()), std::vector<uint8_t>{1});
    // Rank 0 may host the store: nobody may leave before everyone has stopped using it.
    try {
      collectives_->barrier(next_key("shutdown"), options_.timeout, true);
    } catch (const std::exception& e) {
      if (monitor_) monitor_->stop();
      throw DistributedError(fmt::format("rank {} of {}: the other ranks did not finish within trainer.dist_timeout ({} s): {}",
                                         rank(), world_size(), seconds(options_.timeout), one_line(short_error(e))));
    }
    if (monitor_) {
      monitor_->quiet();
      monitor_->stop();
    }
    // Passing the barrier is not leaving it: another rank may still be reading its answer from the
    // store rank 0 hosts. So every other rank says it is out, and rank 0 leaves once all have.
    const std::string left = "strobe/" + next_key("left");
    try {
      if (rank() != 0) {
        store_->set(left + "/" + std::to_string(rank()), std::vector<uint8_t>{1});
      } else {
        std::vector<std::string> keys;
        for (int64_t r = 1; r < world_size(); ++r) keys.push_back(left + "/" + std::to_string(r));
        store_->wait(keys, options_.timeout);
      }
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format("rank {} of {}: the other ranks did not finish within trainer.dist_timeout ({} s): {}",
                                         rank(), world_size(), seconds(options_.timeout), one_line(short_error(e))));
    }
    reducer_.reset();
    if (pg_) pg_->shutdown();
  }

 private:
  // `t` reduced over the ranks in place (on the device: the wait orders the stream, no host sync).
  torch::Tensor allreduce_in_place(torch::Tensor t, c10d::ReduceOp::RedOpType op, CollectiveKind kind) {
    if (record_.skips(kind, rank())) return t;  // tests only (CollectiveRecord::skips)
    const int64_t seq = record_.issue(kind, static_cast<int64_t>(t.nbytes()));
    std::vector<torch::Tensor> one{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    pg_->allreduce(one, o)->wait();
    record_.returned(seq);
    return t;
  }
  static constexpr size_t kBroadcastBytes = 250 * 1024 * 1024;

  std::string next_key(const std::string& what) { return fmt::format("{}/{}", what, seq_++); }

  // A host collective that fails means the job is over: a lost store connection is its host's
  // death, anything else a peer that did not arrive in time.
  template <class F>
  std::invoke_result_t<F> checked(const std::string& what, CollectiveKind kind, int64_t bytes, F&& f) {
    const int64_t seq = record_.issue(kind, bytes);
    try {
      auto out = f();
      record_.returned(seq);
      return out;
    } catch (const c10::DistNetworkError& e) {
      fail_now(rank(), world_size(), lost_store(e));
    } catch (const std::exception& e) {
      fail_now(rank(), world_size(), fmt::format("{} did not complete within trainer.dist_timeout ({} s): {}", what,
                                                 seconds(options_.timeout), one_line(short_error(e))));
    }
  }

  std::string lost_store(const std::exception& e) const { return lost_store_message(address_, e); }

  void rendezvous() {
    const int rank = static_cast<int>(env_.rank), world = static_cast<int>(env_.world_size);
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env_.master_port);
    so.isServer = !env_.agent_store && rank == 0;
    so.numWorkers = static_cast<size_t>(world);
    so.waitWorkers = true;
    so.timeout = options_.timeout;
    so.multiTenant = true;
    try {
      store_ = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, so);
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format(
          "rank {} of {} ({} launch): the rendezvous at {} did not complete within trainer.dist_timeout ({} s): {}", rank,
          world, env_.launcher, address_, seconds(options_.timeout), one_line(short_error(e))));
    }
    auto strobe_store = c10::make_intrusive<c10d::PrefixStore>("strobe", store_);
    collectives_ = c10::make_intrusive<c10d::StoreCollectives>(
        c10::make_intrusive<c10d::PrefixStore>("host", strobe_store), rank, world);

    // The monitor talks over its own connection so a main thread blocked in a store wait does not
    // delay heartbeats.
    c10d::TCPStoreOptions mo;
    mo.port = so.port;
    mo.isServer = false;
    mo.waitWorkers = false;
    mo.timeout = options_.timeout;
    auto monitor_conn = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, mo);
    health_store_ = c10::make_intrusive<c10d::PrefixStore>("strobe/health", monitor_conn);
    monitor_ = std::make_unique<HealthMonitor>(health_store_, env_.rank, env_.world_size, options_.timeout, address_, &record_);
    barrier("heartbeats registered");
    monitor_->start();

    auto pg_store = c10::make_intrusive<c10d::PrefixStore>("pg", strobe_store);
    pg_ = c10::make_intrusive<c10d::ProcessGroup>(pg_store, rank, world);
    c10::intrusive_ptr<c10d::Backend> backend;
    c10d::ProcessGroup::BackendType type;
    if (device_.is_cuda()) {
      backend = make_nccl_backend(c10::make_intrusive<c10d::PrefixStore>("nccl", pg_store), rank, world, options_.timeout);
      type = c10d::ProcessGroup::BackendType::NCCL;
      monitor_->set_flight_recorder(&nccl_flight_record_json);  // NCCL's own record joins the file
    } else {
      auto& factory = cpu_backend_factory();
      backend = factory(c10::make_intrusive<c10d::PrefixStore>("cpu", pg_store), rank, world, options_.timeout);
      type = c10d::ProcessGroup::BackendType::CUSTOM;
    }
    pg_->setBackend(device_.type(), type, backend);
    pg_->setDefaultBackend(type);
    pg_->setGroupName("0");
  }

  static int64_t bytes_of(const std::vector<torch::Tensor>& ts) {
    int64_t n = 0;
    for (const auto& t : ts) n += static_cast<int64_t>(t.nbytes());
    return n;
  }

  StrategyOptions options_;
  LaunchEnv env_;
  torch::Device device_;
  std::string address_;
  CollectiveRecord record_;  // before the monitor that publishes it
  int64_t grad_bytes_ = 0;     // the gradients one backward all-reduces (ddp)
  int64_t grad_seq_ = 0;       // that all-reduce's entry while its backward runs
  int64_t buffers_bytes_ = 0;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Store> health_store_;
  c10::intrusive_ptr<c10d::StoreCollectives> collectives_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::unique_ptr<HealthMonitor> monitor_;
  std::unique_ptr<c10d::Reducer> reducer_;
  std::unique_ptr<Zero2Shards> zero2_;
  std::shared_ptr<FsdpUnitGroup> group_;             // fsdp
  std::vector<std::unique_ptr<FsdpUnit>> units_;     // fsdp: model order, the kept unit first
  std::vector<torch::Tensor> buffers_;
  uint64_t seq_ = 0;
  bool sync_ = true;
  bool pending_ = false;
  bool shut_down_ = false;
  bool aborted_ = false;
};

void on_terminate() {
  if (DDPStrategy* s = g_live_strategy.load(); s != nullptr) {
    if (auto current = std::current_exception()) {
      try {
        std::rethrow_exception(current);
      } catch (const std::exception& e) {
        const std::string why = short_error(e);
        if (is_collective_error(e) || why.find("NCCL") != std::string::npos) s->collective_failed(why);
      } catch (...) {
      }
    }
  }
  if (g_previous_terminate) g_previous_terminate();
  std::abort();
}

}  // namespace

namespace detail {

std::unique_ptr<Strategy> make_ddp_strategy(const StrategyOptions& options, const LaunchEnv& env, torch::Device device) {
  return std::make_unique<DDPStrategy>(options, env, device);
}

}  // namespace detail

}  // namespace strobe::distributed
