// Data parallel over NCCL on 2 GPUs: 2 processes on 127.0.0.1 (one per GPU, cuda:LOCAL_RANK) that
// rendezvous through a TCPStore as under torchrun. Skips (with the reason) without 2 visible GPUs.
// The parent never touches CUDA (its children could not initialize it after a fork).
// STROBE_DDP_BENCH=<json file> adds the scaling benchmark of docs/PERFORMANCE.md (resnet50 and
// vit_l16, b128 per GPU, bf16-mixed, 1 vs 2 GPUs; 5 warm-up steps, 15 timed).
#include <gtest/gtest.h>
#include <torch/torch.h>

#ifdef STROBE_TORCH_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <ATen/CPUGeneratorImpl.h>

#include <csignal>
#include <mutex>
#include <fstream>

#include "strobe/core/precision.h"
#include "strobe/distributed/strategy.h"
#include "models/resnet.h"
#include "models/vit.h"
#include "tests/distributed/multiprocess.h"
#include "tests/test_dirs.h"

namespace sd = strobe::distributed;
namespace st = strobe::testing;
using std::chrono::milliseconds;

namespace {

constexpr int kSkip = 77;

std::string test_dir(const std::string& name) {
  return st::empty_test_dir("strobe_gpu_ddp_" + name + "_" + std::to_string(::getpid())).string();
}

bool skipped(const std::vector<st::RankResult>& rs) {
  for (auto& r : rs)
    if (r.exit_code == kSkip) return true;
  return false;
}

// In a child: fewer than 2 GPUs (or no CUDA in this libtorch) -> skip the test.
bool too_few_gpus() {
#ifndef STROBE_TORCH_HAS_CUDA
  return true;
#else
  return torch::cuda::device_count() < 2;
#endif
}

sd::StrategyOptions gpu_options(milliseconds timeout = milliseconds(120000)) {
  sd::StrategyOptions o;
  o.device = "auto";
  o.timeout = timeout;
  return o;
}

// Seeds the CPU generator only: torch::manual_seed would also seed (and so initialize) CUDA in the
// parent, after which its forked children cannot use CUDA.
void seed_cpu(uint64_t seed) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

torch::nn::Sequential make_mlp(uint64_t seed) {
  seed_cpu(seed);
  return torch::nn::Sequential(torch::nn::Linear(256, 1024), torch::nn::Tanh(), torch::nn::Linear(1024, 256),
                               torch::nn::Tanh(), torch::nn::Linear(256, 4));
}

constexpr int kWorld = 2, kSteps = 4, kAccum = 2, kPerRank = 16;

std::pair<torch::Tensor, torch::Tensor> global_batch(int step, int m) {
  seed_cpu(2000 + 10 * step + m);
  return {torch::randn({kWorld * kPerRank, 256}), torch::randn({kWorld * kPerRank, 4})};
}

// Rank `rank`'s share of every micro-batch of the run, on `dev`.
std::vector<std::pair<torch::Tensor, torch::Tensor>> rank_batches(int rank, const torch::Device& dev) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int step = 0; step < kSteps; ++step)
    for (int m = 0; m < kAccum; ++m) {
      auto [x, y] = global_batch(step, m);
      batches.emplace_back(x.narrow(0, rank * kPerRank, kPerRank).to(dev), y.narrow(0, rank * kPerRank, kPerRank).to(dev));
    }
  return batches;
}

// One optimizer step's micro-batches through the strategy's hooks: sync on the last one.
void backward_micro_batches(sd::Strategy& strategy, torch::nn::Sequential& net,
                            const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches, int step) {
  for (int m = 0; m < kAccum; ++m) {
    const auto& [x, y] = batches[step * kAccum + m];
    strategy.set_grad_sync(m == kAccum - 1);
    auto loss = torch::mse_loss(net->forward(x), y) / kAccum;
    strategy.pre_backward();
    loss.backward();
  }
}

// One process on the union batch, the reference both NCCL equivalence tests end at: the
// parameters after kSteps SGD steps, and the last step's per-parameter gradient norms.
std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> one_process_on_the_union_batch() {
  auto net = make_mlp(100);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  std::vector<torch::Tensor> last_norms;
  for (int step = 0; step < kSteps; ++step) {
    for (int m = 0; m < kAccum; ++m) {
      auto [x, y] = global_batch(step, m);
      (torch::mse_loss(net->forward(x), y) / kAccum).backward();
    }
    last_norms.clear();
    for (auto& p : net->parameters()) last_norms.push_back(p.grad().norm());
    opt.step();
    opt.zero_grad();
  }
  return {net->parameters(), last_norms};
}

#ifdef STROBE_TORCH_HAS_CUDA
// Runs f with CUDA sync-debug mode "error": any host-device synchronization throws.
template <class F>
void without_host_sync(F&& f) {
  auto& warn = c10::cuda::warning_state();
  warn.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    f();
  } catch (...) {
    warn.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    throw;
  }
  warn.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
}
#endif

}  // namespace

TEST(GpuDDP, NcclTwoRanksMatchOneProcessOnTheUnionBatchWithoutHostSyncs) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  const std::string dir = test_dir("equiv");
  auto rs = st::run_ranks(kWorld, [&](int rank) {
    if (too_few_gpus()) return kSkip;
    auto strategy = sd::make_strategy(gpu_options());
    const auto dev = strategy->device();
    if (dev != torch::Device(torch::kCUDA, rank)) return 5;
    auto net = make_mlp(100 + rank);
    net->to(dev);
    strategy->setup_model(*net);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const auto batches = rank_batches(rank, dev);
    auto flag = torch::zeros({}, torch::TensorOptions().device(dev));
    torch::cuda::synchronize();
    for (int step = 0; step < kSteps; ++step) {
      auto body = [&] {
        backward_micro_batches(*strategy, net, batches, step);
        strategy->finish_grad_sync();
        strategy->reduce_max(flag, strobe::distributed::CollectiveKind::kLossAgreement);
        opt.step();
        opt.zero_grad();
      };
      // The first two steps build and rebuild the buckets (host work by design); after that a step
      // never waits for the GPU.
      if (step < 2) body(); else without_host_sync(body);
    }
    std::vector<torch::Tensor> params;
    for (auto& p : net->parameters()) params.push_back(p.detach().cpu());
    torch::save(params, dir + "/params" + std::to_string(rank) + ".pt");
    strategy->shutdown();
    return 0;
  }, dir, std::chrono::seconds(180), nullptr);
  if (skipped(rs)) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);
  const auto params = one_process_on_the_union_batch().first;
  for (int r = 0; r < kWorld; ++r) {
    std::vector<torch::Tensor> got;
    torch::load(got, dir + "/params" + std::to_string(r) + ".pt");
    ASSERT_EQ(got.size(), params.size());
    for (size_t i = 0; i < got.size(); ++i) {
      double err = (got[i] - params[i]).abs().max().item<double>();
      EXPECT_LE(err, 1e-4 * std::max(1.0, params[i].abs().max().item<double>())) << "rank " << r << " parameter " << i;
    }
  }
  std::vector<torch::Tensor> p0, p1;
  torch::load(p0, dir + "/params0.pt");
  torch::load(p1, dir + "/params1.pt");
  for (size_t i = 0; i < p0.size(); ++i) EXPECT_TRUE(torch::equal(p0[i], p1[i])) << "ranks diverged at parameter " << i;
#endif
}

// ZeRO-2 over NCCL (strobe/distributed/zero2.h), as the step pipeline drives it: reduce-scatter in
// backward, the per-parameter squared norms all-reduced, SGD on the shards, the all-gather. From
// the third step on not one host synchronization (CUDA sync-debug "error"); the parameters end
// where one process on the union batch ends, bitwise equal on both ranks; no parameter keeps a full
// gradient, and each rank's optimizer holds ceil(dim0 / 2) rows of every parameter.
TEST(GpuZero2, NcclShardsMatchOneProcessOnTheUnionBatchWithoutHostSyncs) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  const std::string dir = test_dir("zero2");
  auto rs = st::run_ranks(kWorld, [&](int rank) {
    if (too_few_gpus()) return kSkip;
    auto o = gpu_options();
    o.zero2 = true;
    o.bucket_cap_mb = 1;  // several buckets in flight
    auto strategy = sd::make_strategy(o);
    const auto dev = strategy->device();
    auto net = make_mlp(100 + rank);
    net->to(dev);
    strategy->setup_model(*net);
    std::vector<sd::ShardedParam> sp;
    for (auto& p : net->named_parameters()) sp.push_back({p.key(), p.value(), p.value()});
    auto* z = strategy->shard_parameters(sp);
    if (!z) return 6;
    int64_t shard_numel = 0;
    for (auto& t : z->shards()) shard_numel += t.numel();
    torch::optim::SGD opt(z->shards(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const auto batches = rank_batches(rank, dev);
    torch::Tensor norms;
    bool full_grads_kept = false;
    torch::cuda::synchronize();
    for (int step = 0; step < kSteps; ++step) {
      auto body = [&] {
        backward_micro_batches(*strategy, net, batches, step);
        strategy->finish_grad_sync();
        for (auto& p : net->parameters()) full_grads_kept |= p.grad().defined();
        std::vector<torch::Tensor> grads;
        for (auto& t : z->shards()) grads.push_back(t.grad());
        auto squares = torch::stack(at::_foreach_norm(grads, 2, torch::kFloat32)).square();
        strategy->reduce_sum(squares, strobe::distributed::CollectiveKind::kGradNorms);
        norms = squares.sqrt();
        opt.step();
        z->gather_params();
        opt.zero_grad();
      };
      if (step < 2) body(); else without_host_sync(body);
    }
    std::vector<torch::Tensor> params;
    for (auto& p : net->parameters()) params.push_back(p.detach().cpu());
    params.push_back(norms.cpu());
    params.push_back(torch::tensor({shard_numel, static_cast<int64_t>(full_grads_kept)}));
    torch::save(params, dir + "/params" + std::to_string(rank) + ".pt");
    strategy->shutdown();
    return 0;
  }, dir, std::chrono::seconds(180), nullptr);
  if (skipped(rs)) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);
  const auto [params, last_norms] = one_process_on_the_union_batch();
  int64_t full = 0, half = 0;
  for (auto& p : params) full += p.numel(), half += (p.size(0) + 1) / 2 * (p.numel() / p.size(0));
  std::vector<torch::Tensor> p0, p1;
  torch::load(p0, dir + "/params0.pt");
  torch::load(p1, dir + "/params1.pt");
  ASSERT_EQ(p0.size(), params.size() + 2);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::equal(p0[i], p1[i])) << "ranks diverged at parameter " << i;
    const double err = (p0[i] - params[i]).abs().max().item<double>();
    EXPECT_LE(err, 1e-4 * std::max(1.0, params[i].abs().max().item<double>())) << "parameter " << i;
  }
  auto expected_norms = torch::stack(last_norms);
  EXPECT_TRUE(torch::allclose(p0[params.size()], expected_norms, 1e-4, 1e-6)) << p0[params.size()] << expected_norms;
  EXPECT_EQ(p0.back()[0].item<int64_t>(), half) << "of " << full;
  EXPECT_EQ(p0.back()[1].item<int64_t>(), 0) << "a parameter kept its full gradient";
#endif
}

TEST(GpuDDP, NonFiniteOnOneRankReachesEveryRankOnTheDevice) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  const std::string dir = test_dir("flag");
  auto rs = st::run_ranks(kWorld, [&](int rank) {
    if (too_few_gpus()) return kSkip;
    auto strategy = sd::make_strategy(gpu_options());
    const auto dev = strategy->device();
    auto grad = torch::ones({1000}, torch::TensorOptions().device(dev));
    if (rank == 1) grad.index_put_({7}, std::numeric_limits<float>::quiet_NaN());
    torch::Tensor flag;
    without_host_sync([&] {
      flag = grad.isfinite().logical_not().any().to(torch::kFloat);
      strategy->reduce_max(flag, strobe::distributed::CollectiveKind::kLossAgreement);
    });
    std::ofstream(dir + "/flag" + std::to_string(rank)) << flag.item<float>();
    strategy->shutdown();
    return 0;
  }, dir, std::chrono::seconds(120), nullptr);
  if (skipped(rs)) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);
  for (int r = 0; r < kWorld; ++r) {
    std::ifstream in(dir + "/flag" + std::to_string(r));
    float v = -1;
    in >> v;
    EXPECT_EQ(v, 1.0f) << "rank " << r;
  }
#endif
}

TEST(GpuDDP, KilledRankEndsTheOtherWithOneClearLineWithinTheTimeout) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  const std::string dir = test_dir("killed");
  auto rs = st::run_ranks(kWorld, [&](int rank) {
    if (too_few_gpus()) return kSkip;
    auto strategy = sd::make_strategy(gpu_options(milliseconds(8000)));
    auto net = make_mlp(1);
    net->to(strategy->device());
    strategy->setup_model(*net);
    torch::cuda::synchronize();
    if (rank == 1) std::raise(SIGKILL);
    auto loss = net->forward(torch::randn({4, 256}, torch::TensorOptions().device(strategy->device()))).sum();
    strategy->pre_backward();
    loss.backward();
    torch::cuda::synchronize();  // waits for an all-reduce whose partner is dead
    strategy->shutdown();
    return 0;
  }, dir, std::chrono::seconds(120), nullptr);
  if (skipped(rs)) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
  EXPECT_EQ(rs[1].exit_code, 128 + SIGKILL) << describe(rs);
  EXPECT_EQ(rs[0].exit_code, 1) << describe(rs);
  EXPECT_NE(rs[0].stderr_text.find("strobe: rank 0 of 2: distributed job failed: rank 1 stopped responding"), std::string::npos)
      << describe(rs);
  EXPECT_LT(rs[0].seconds, 8.0 + 20.0) << describe(rs);  // + process and CUDA start-up
#endif
}

TEST(GpuDDP, ScalingBenchmark) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  const char* out_path = std::getenv("STROBE_DDP_BENCH");
  if (!out_path) GTEST_SKIP() << "benchmark: set STROBE_DDP_BENCH=<json file> to run it";
  std::ofstream out(out_path);
  out << "[\n";
  bool first = true;
  for (std::string model : {"resnet50", "vit_l16"}) {
    for (int world : {1, 2}) {
      const std::string dir = test_dir("bench_" + model + std::to_string(world));
      auto rs = st::run_ranks(world, [&](int rank) {
        if (world == 2 && too_few_gpus()) return kSkip;
        auto strategy = sd::make_strategy(gpu_options());
        const auto dev = strategy->device();
        std::shared_ptr<strobe::Model> net;
        if (model == "resnet50") {
          strobe::models::ResNetOptions o;
          o.depth = 50;
          net = strobe::models::make_resnet(o);
        } else {
          strobe::models::ViTOptions o;
          o.embed_dim = 1024;
          o.depth = 24;
          o.num_heads = 16;
          o.class_token = false;
          o.global_pool = "avg";
          o.attention = strobe::models::AttentionBackend::Sdpa;
          net = strobe::models::make_vit(o);
        }
        net->to(dev);
        strategy->setup_model(*net);
        torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
        const int64_t b = 128;
        strobe::Batch batch;
        batch["image"] = torch::randn({b, 3, 224, 224}, torch::TensorOptions().device(dev));
        auto labels = torch::randint(0, 1000, {b}, torch::TensorOptions().device(dev).dtype(torch::kLong));
        auto step = [&] {
          torch::Tensor loss;
          {
            strobe::AutocastGuard ac(dev, strobe::Precision::kBf16Mixed);
            loss = torch::cross_entropy_loss(net->forward(batch), labels);
          }
          strategy->pre_backward();
          loss.backward();
          strategy->finish_grad_sync();
          opt.step();
          opt.zero_grad(true);
        };
        for (int i = 0; i < 5; ++i) step();
        strategy->barrier("bench warm");
        torch::cuda::synchronize();
        const int n = 15;
        at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
        start.record();
        for (int i = 0; i < n; ++i) step();
        stop.record();
        stop.synchronize();
        const double ms = start.elapsed_time(stop) / n;
        if (rank == 0) std::ofstream(dir + "/result") << ms << " " << world * b * 1000.0 / ms;
        strategy->shutdown();
        return 0;
      }, dir, std::chrono::seconds(300), nullptr);
      if (skipped(rs)) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
      for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);
      double ms = 0, ips = 0;
      std::ifstream(dir + "/result") >> ms >> ips;
      std::printf("strobe ddp bench: %s gpus=%d step_ms=%.2f images_per_s=%.1f\n", model.c_str(), world, ms, ips);
      out << (first ? "" : ",\n") << "{\"impl\": \"strobe\", \"model\": \"" << model << "\", \"gpus\": " << world
          << ", \"step_ms\": " << ms << ", \"images_per_s\": " << ips << "}";
      first = false;
    }
  }
  out << "\n]\n";
#endif
}
