// Real multi-process data parallel on CPU: every test forks 2 ranks on 127.0.0.1 that rendezvous
// through a TCPStore exactly as under torchrun, with the labelled store-backed test double as the
// c10d CPU backend (store_backend.h). What runs is the product's strategy: ProcessGroup dispatch,
// c10d::Reducer with its autograd hooks and buckets, metric syncs, the health monitor.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <csignal>
#include <mutex>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "strobe/config/config.h"
#include "strobe/distributed/strategy.h"
#include "strobe/metrics/aggregation.h"
#include "strobe/metrics/classification.h"
#include "strobe/metrics/collection.h"
#include "tests/distributed/multiprocess.h"
#include "tests/test_dirs.h"
#include "tests/distributed/store_backend.h"

namespace sd = strobe::distributed;
namespace st = strobe::testing;
using st::count_lines_with;
using st::describe;
using std::chrono::milliseconds;

namespace {

std::string test_dir(const std::string& name) {
  return st::empty_test_dir("strobe_ddp_" + name + "_" + std::to_string(::getpid())).string();
}

sd::StrategyOptions cpu_options(milliseconds timeout = milliseconds(60000)) {
  sd::StrategyOptions o;
  o.device = "cpu";
  o.timeout = timeout;
  return o;
}

// Seeds the CPU generator only: torch::manual_seed also initializes CUDA where a GPU is visible,
// and a process that forks ranks after that hands them a broken CUDA state.
void seed_cpu(uint64_t seed) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

// ~2 MiB of parameters: more than the 1 MiB first bucket, so the rebuilt buckets are several.
torch::nn::Sequential make_mlp(uint64_t seed) {
  seed_cpu(seed);
  return torch::nn::Sequential(torch::nn::Linear(256, 1024), torch::nn::Tanh(), torch::nn::Linear(1024, 256),
                               torch::nn::Tanh(), torch::nn::Linear(256, 4));
}

constexpr int kWorld = 2, kSteps = 4, kAccum = 2, kPerRank = 8;

// The global micro-batch (union of the ranks' shares) of optimizer step `step`, micro-batch `m`.
std::pair<torch::Tensor, torch::Tensor> global_batch(int step, int m) {
  seed_cpu(1000 + 10 * step + m);
  return {torch::randn({kWorld * kPerRank, 256}), torch::randn({kWorld * kPerRank, 4})};
}

}  // namespace

TEST(DDP, ParametersAfterStepsEqualOneProcessOnTheUnionBatch) {
  const std::string dir = test_dir("equiv");
  auto rs = st::run_ranks(kWorld, [&](int rank) {
    torch::set_num_threads(1);
    auto strategy = sd::make_strategy(cpu_options());
    // Different initial weights on each rank: setup_model must replace them with rank 0's.
    auto net = make_mlp(100 + rank);
    strategy->setup_model(*net);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<torch::Tensor> local_grads;
    std::vector<int64_t> calls_in_backward;
    for (int step = 0; step < kSteps; ++step) {
      for (int m = 0; m < kAccum; ++m) {
        auto [x, y] = global_batch(step, m);
        x = x.narrow(0, rank * kPerRank, kPerRank);
        y = y.narrow(0, rank * kPerRank, kPerRank);
        strategy->set_grad_sync(m == kAccum - 1);
        auto loss = torch::mse_loss(net->forward(x), y) / kAccum;
        strategy->pre_backward();
        const int64_t before = st::store_backend_allreduce_calls();
        loss.backward();
        calls_in_backward.push_back(st::store_backend_allreduce_calls() - before);
        if (step == 0 && m == 0)
          for (auto& p : net->parameters()) local_grads.push_back(p.grad().clone());
      }
      strategy->finish_grad_sync();
      opt.step();
      opt.zero_grad();
    }
    std::vector<torch::Tensor> params;
    for (auto& p : net->parameters()) params.push_back(p.detach().clone());
    torch::save(params, dir + "/params" + std::to_string(rank) + ".pt");
    torch::save(local_grads, dir + "/local_grads" + std::to_string(rank) + ".pt");
    torch::save(torch::tensor(calls_in_backward), dir + "/calls" + std::to_string(rank) + ".pt");
    strategy->shutdown();
    return 0;
  }, dir, std::chrono::seconds(120), st::install_store_backend);
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);

  // One process, the same initial weights as rank 0, the union batch.
  auto net = make_mlp(100);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  std::vector<torch::Tensor> expected_local;
  for (int step = 0; step < kSteps; ++step) {
    for (int m = 0; m < kAccum; ++m) {
      auto [x, y] = global_batch(step, m);
      if (step == 0 && m == 0) {
        // What rank 1 holds after its first micro-batch if nothing was all-reduced.
        auto ref = make_mlp(100);
        (torch::mse_loss(ref->forward(x.narrow(0, kPerRank, kPerRank)), y.narrow(0, kPerRank, kPerRank)) / kAccum).backward();
        for (auto& p : ref->parameters()) expected_local.push_back(p.grad().clone());
      }
      (torch::mse_loss(net->forward(x), y) / kAccum).backward();
    }
    opt.step();
    opt.zero_grad();
  }
  auto params = net->parameters();
  for (int r = 0; r < kWorld; ++r) {
    std::vector<torch::Tensor> got;
    torch::load(got, dir + "/params" + std::to_string(r) + ".pt");
    ASSERT_EQ(got.size(), params.size());
    for (size_t i = 0; i < got.size(); ++i) {
      double err = (got[i] - params[i]).abs().max().item<double>();
      double scale = params[i].abs().max().item<double>();
      EXPECT_LE(err, 1e-5 * std::max(1.0, scale)) << "rank " << r << " parameter " << i;
    }
  }
  // The accumulation micro-batch all-reduced nothing: rank 1's gradient was its own.
  std::vector<torch::Tensor> local1;
  torch::load(local1, dir + "/local_grads1.pt");
  for (size_t i = 0; i < local1.size(); ++i) EXPECT_TRUE(torch::allclose(local1[i], expected_local[i], 1e-5, 1e-6)) << i;
  // Micro-batches with sync off make no all-reduce; synced backwards make one per bucket, from the
  // autograd hooks while backward runs: one bucket on the first step, several once rebuilt.
  torch::Tensor calls;
  torch::load(calls, dir + "/calls0.pt");
  auto c = calls.accessor<int64_t, 1>();
  for (int step = 0; step < kSteps; ++step) EXPECT_EQ(c[step * kAccum], 0) << "step " << step;
  EXPECT_EQ(c[kAccum - 1], 1);
  for (int step = 1; step < kSteps; ++step) EXPECT_GE(c[step * kAccum + kAccum - 1], 2) << "step " << step;
}

TEST(DDP, FlagsHostDecisionsBuffersAndMetricsAgreeAcrossRanks) {
  const std::string dir = test_dir("flags");
  auto rs = st::run_ranks(kWorld, [&](int rank) {
    torch::set_num_threads(1);
    auto strategy = sd::make_strategy(cpu_options());
    std::ofstream out(dir + "/result" + std::to_string(rank) + ".txt");
    out << "rank=" << strategy->rank() << " world=" << strategy->world_size() << " local=" << strategy->local_rank()
        << " zero=" << strategy->is_global_zero() << "\n";
    // A non-finite flag raised on rank 1 only reaches every rank.
    auto flag = torch::tensor(rank == 1 ? 1.0f : 0.0f);
    strategy->reduce_max(flag, sd::CollectiveKind::kLossAgreement);
    out << "max=" << flag.item<float>() << "\n";
    out << "any_rank1=" << strategy->any(rank == 1) << " any_none=" << strategy->any(false) << "\n";
    out << "bcast=" << strategy->broadcast_string(rank == 0 ? "runs/x/version_3" : "wrong") << "\n";
    auto gathered = strategy->gather_strings(std::string("rng of rank ") + std::to_string(rank));
    out << "gather=";
    for (auto& g : gathered) out << "[" << g << "]";
    out << "\n";
    strategy->barrier("test");
    // Metric states all-reduced: the mean of both ranks' values.
    strobe::metrics::MeanMetric mean;
    mean.update(torch::tensor({1.0f, 2.0f}) + 10 * rank);
    strategy->sync_metric(mean);
    out << "mean=" << mean.compute().item<float>() << "\n";
    strobe::metrics::MetricOptions mo;
    mo.num_classes = 3;
    mo.average = strobe::metrics::Average::kMicro;
    strobe::metrics::MetricCollection coll;
    coll.add("acc", std::make_unique<strobe::metrics::Accuracy>(mo));
    // Rank 0 gets 2 of 2 right, rank 1 gets 0 of 2: synced accuracy 0.5.
    auto preds = torch::tensor({0, 1}, torch::kLong);
    coll.update(preds, rank == 0 ? preds : torch::tensor({2, 2}, torch::kLong));
    strategy->sync_metrics(coll);
    out << "acc=" << coll.compute()[0].second.item<float>() << "\n";
    // BatchNorm statistics: rank 0's win on a synced step; gradients are averaged.
    seed_cpu(7 + rank);
    torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
    strategy->setup_model(*net);
    auto x = torch::randn({6, 4}) * (1 + rank) + rank;
    auto loss = net->forward(x).pow(2).mean();
    strategy->pre_backward();
    loss.backward();
    strategy->finish_grad_sync();
    torch::save(std::vector<torch::Tensor>{net->named_buffers()["1.running_mean"], net->parameters()[0].grad()},
                dir + "/bn" + std::to_string(rank) + ".pt");
    out.close();
    strategy->shutdown();
    return 0;
  }, dir, std::chrono::seconds(120), st::install_store_backend);
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);
  for (int r = 0; r < kWorld; ++r) {
    std::ifstream in(dir + "/result" + std::to_string(r) + ".txt");
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_EQ(ss.str(), "rank=" + std::to_string(r) + " world=2 local=" + std::to_string(r) + " zero=" + (r == 0 ? "1" : "0") +
                            "\nmax=1\nany_rank1=1 any_none=0\nbcast=runs/x/version_3\n" +
                            (r == 0 ? "gather=[rng of rank 0][rng of rank 1]\n" : "gather=\n") + "mean=6.5\nacc=0.5\n");
  }
  std::vector<torch::Tensor> b0, b1;
  torch::load(b0, dir + "/bn0.pt");
  torch::load(b1, dir + "/bn1.pt");
  EXPECT_TRUE(torch::equal(b0[0], b1[0]));
  EXPECT_TRUE(torch::equal(b0[1], b1[1]));
  EXPECT_GT(b0[0].abs().sum().item<float>(), 0.0f);
}

// The test double's reduce-scatters and all-gathers into one tensor, called through the process
// group as a strategy calls them, on three ranks (each rank's values differ, so a chunk taken from
// the wrong rank or place shows): what every rank holds is checked against the definition computed
// here from all ranks' inputs.
namespace {
constexpr int kCollWorld = 3;
// Rank r's input of collective `which`: n values, different per rank and position.
torch::Tensor coll_input(int which, int rank, int64_t n, torch::ScalarType dtype = torch::kFloat32) {
  return (torch::arange(n, torch::kFloat32) * (rank + 1) * (which + 1) + 0.25 * rank - 3).to(dtype);
}
}  // namespace

TEST(DDP, TheTestDoubleReduceScattersAndAllGathersAsDefined) {
  const std::string dir = test_dir("collectives");
  auto rs = st::run_ranks(kCollWorld, [&](int rank) {
    torch::set_num_threads(1);
    auto strategy = sd::make_strategy(cpu_options());
    auto* pg = strategy->process_group();
    std::vector<torch::Tensor> got;
    // _reduce_scatter_base, AVG and SUM; the input is 2-d and read flat.
    for (auto op : {c10d::ReduceOp::AVG, c10d::ReduceOp::SUM}) {
      auto in = coll_input(0, rank, kCollWorld * 6).view({kCollWorld * 2, 3});
      auto out = torch::full({2, 3}, std::nan(""));
      c10d::ReduceScatterOptions o;
      o.reduceOp = op;
      pg->_reduce_scatter_base(out, in, o)->wait();
      got.push_back(out);
    }
    // reduce_scatter_tensor_coalesced: two pairs, fp32 and bf16, AVG.
    {
      std::vector<torch::Tensor> in{coll_input(1, rank, kCollWorld * 5), coll_input(2, rank, kCollWorld * 4, torch::kBFloat16)};
      std::vector<torch::Tensor> out{torch::full({5}, std::nan("")), torch::full({4}, std::nan(""), torch::kBFloat16)};
      c10d::ReduceScatterOptions o;
      o.reduceOp = c10d::ReduceOp::AVG;
      pg->reduce_scatter_tensor_coalesced(out, in, o)->wait();
      got.insert(got.end(), out.begin(), out.end());
    }
    // _allgather_base into a 2-d output; allgather_into_tensor_coalesced, fp32 and bf16.
    {
      auto in = coll_input(3, rank, 4);
      auto out = torch::full({kCollWorld, 4}, std::nan(""));
      pg->_allgather_base(out, in)->wait();
      got.push_back(out);
      std::vector<torch::Tensor> ins{coll_input(4, rank, 3), coll_input(5, rank, 2, torch::kBFloat16)};
      std::vector<torch::Tensor> outs{torch::full({kCollWorld * 3}, std::nan("")),
                                      torch::full({kCollWorld * 2}, std::nan(""), torch::kBFloat16)};
      pg->allgather_into_tensor_coalesced(outs, ins)->wait();
      got.insert(got.end(), outs.begin(), outs.end());
    }
    // A size that is not world_size x the output is refused on every rank before any exchange, and
    // the next collective still pairs up.
    std::string refused;
    try {
      auto in = torch::zeros({7});
      auto out = torch::zeros({2});
      pg->_reduce_scatter_base(out, in)->wait();
    } catch (const std::exception& e) {
      refused = e.what();
    }
    if (refused.find("not world_size x the output's 2") == std::string::npos) {
      std::fprintf(stderr, "not refused: '%s'\n", refused.c_str());
      return 1;
    }
    auto last_in = torch::tensor({static_cast<float>(rank)});
    auto last_out = torch::zeros({kCollWorld});
    pg->_allgather_base(last_out, last_in)->wait();
    got.push_back(last_out);
    got.push_back(torch::tensor({st::store_backend_reduce_scatter_calls(), st::store_backend_allgather_calls()}));
    torch::save(got, dir + "/got" + std::to_string(rank) + ".pt");
    strategy->shutdown();
    return 0;
  }, dir, std::chrono::seconds(120), st::install_store_backend);
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);

  // The definitions, from every rank's inputs.
  auto chunk = [](const torch::Tensor& flat, int r, int64_t n) { return flat.reshape({-1}).narrow(0, r * n, n); };
  auto reduce_chunk = [&](int which, int r, int64_t n, bool avg, torch::ScalarType dtype) {
    auto acc = chunk(coll_input(which, 0, kCollWorld * n, dtype), r, n).clone();
    for (int q = 1; q < kCollWorld; ++q) acc.add_(chunk(coll_input(which, q, kCollWorld * n, dtype), r, n));
    return avg ? acc / kCollWorld : acc;
  };
  auto gathered = [&](int which, int64_t n, torch::ScalarType dtype) {
    std::vector<torch::Tensor> parts;
    for (int q = 0; q < kCollWorld; ++q) parts.push_back(coll_input(which, q, n, dtype));
    return torch::cat(parts);
  };
  for (int r = 0; r < kCollWorld; ++r) {
    std::vector<torch::Tensor> got;
    torch::load(got, dir + "/got" + std::to_string(r) + ".pt");
    ASSERT_EQ(got.size(), 9u);
    EXPECT_TRUE(torch::equal(got[0], reduce_chunk(0, r, 6, true, torch::kFloat32).view({2, 3}))) << "rank " << r << ": AVG " << got[0];
    EXPECT_TRUE(torch::equal(got[1], reduce_chunk(0, r, 6, false, torch::kFloat32).view({2, 3}))) << "rank " << r << ": SUM " << got[1];
    EXPECT_TRUE(torch::equal(got[2], reduce_chunk(1, r, 5, true, torch::kFloat32))) << "rank " << r << ": coalesced fp32";
    EXPECT_EQ(got[3].scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(got[3], reduce_chunk(2, r, 4, true, torch::kBFloat16))) << "rank " << r << ": coalesced bf16";
    EXPECT_TRUE(torch::equal(got[4], gathered(3, 4, torch::kFloat32).view({kCollWorld, 4}))) << "rank " << r << ": allgather_base";
    EXPECT_TRUE(torch::equal(got[5], gathered(4, 3, torch::kFloat32))) << "rank " << r << ": allgather coalesced fp32";
    EXPECT_TRUE(torch::equal(got[6], gathered(5, 2, torch::kBFloat16))) << "rank " << r << ": allgather coalesced bf16";
    EXPECT_TRUE(torch::equal(got[7], torch::tensor({0.f, 1.f, 2.f}))) << "rank " << r << ": after the refusal " << got[7];
    // Completed calls, a coalesced one counting once: 2 + 1 reduce-scatters, 1 + 1 + 1 all-gathers.
    EXPECT_EQ(got[8][0].item<int64_t>(), 3) << "rank " << r;
    EXPECT_EQ(got[8][1].item<int64_t>(), 3) << "rank " << r;
  }
}

// ZeRO-2's buckets go out in bucket order on every rank, whatever order each rank's backward finishes
// them in: here the two ranks' graphs make the two parameters' gradients ready in opposite orders
// (rank 0 multiplies by w1 last, rank 1 by w2), each parameter in a bucket of its own. Every shard's
// gradient is the mean of the ranks' gradients, computed here; launched as completed, rank 0's w1
// would meet rank 1's w2 in the first reduce-scatter.
TEST(Zero2Shards, BucketsGoOutInOrderWhateverOrderBackwardFinishesThem) {
  const std::string dir = test_dir("zero2_order");
  auto x_of = [](int r) { return torch::arange(12, torch::kFloat32).view({4, 3}) * (r + 1) - 5; };
  auto rs = st::run_ranks(kWorld, [&](int rank) {
    torch::set_num_threads(1);
    auto o = cpu_options();
    o.zero2 = true;
    o.bucket_cap_mb = 0;  // one parameter per bucket
    auto strategy = sd::make_strategy(o);
    auto w1 = torch::linspace(0.5, 2, 12).view({4, 3}).requires_grad_();
    auto w2 = torch::linspace(-1, 1, 12).view({4, 3}).requires_grad_();
    auto* z = strategy->shard_parameters({{"w1", w1, w1}, {"w2", w2, w2}});
    strategy->set_grad_sync(true);
    strategy->pre_backward();
    auto x = x_of(rank);
    auto loss = rank == 0 ? (w1 * (w2 * x)).square().sum() : (w2 * (w1 * x)).square().sum();
    loss.backward();
    strategy->finish_grad_sync();
    torch::save(std::vector<torch::Tensor>{z->shards()[0].grad().clone(), z->shards()[1].grad().clone()},
                dir + "/grads" + std::to_string(rank) + ".pt");
    strategy->shutdown();
    return 0;
  }, dir, std::chrono::seconds(60), st::install_store_backend);
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);
  // The reference: each rank's gradients of the same function, averaged; rank r holds rows [2r, 2r + 2).
  std::vector<torch::Tensor> mean(2);
  for (int r = 0; r < kWorld; ++r) {
    auto w1 = torch::linspace(0.5, 2, 12).view({4, 3}).requires_grad_();
    auto w2 = torch::linspace(-1, 1, 12).view({4, 3}).requires_grad_();
    (w1 * w2 * x_of(r)).square().sum().backward();
    for (int k = 0; k < 2; ++k) {
      auto g = (k == 0 ? w1 : w2).grad() / kWorld;
      mean[k] = mean[k].defined() ? mean[k] + g : g;
    }
  }
  for (int r = 0; r < kWorld; ++r) {
    std::vector<torch::Tensor> got;
    torch::load(got, dir + "/grads" + std::to_string(r) + ".pt");
    for (int k = 0; k < 2; ++k)
      EXPECT_TRUE(torch::allclose(got[k], mean[k].narrow(0, 2 * r, 2), 1e-6, 1e-6))
          << "rank " << r << " w" << k + 1 << ": " << got[k] << " vs " << mean[k].narrow(0, 2 * r, 2);
  }
}

TEST(DDP, KilledRankEndsTheOtherWithOneClearLineWithinTheTimeout) {
  const std::string dir = test_dir("killed");
  const milliseconds timeout(4000);
  auto rs = st::run_ranks(kWorld, [&](int rank) {
    torch::set_num_threads(1);
    auto strategy = sd::make_strategy(cpu_options(timeout));
    auto net = make_mlp(1);
    strategy->setup_model(*net);
    if (rank == 1) std::raise(SIGKILL);
    // Rank 0 goes on into a step whose all-reduce has no partner.
    auto loss = net->forward(torch::randn({2, 256})).sum();
    strategy->pre_backward();
    loss.backward();
    strategy->shutdown();
    return 0;
  }, dir, std::chrono::seconds(60), st::install_store_backend);
  EXPECT_EQ(rs[1].exit_code, 128 + SIGKILL);
  EXPECT_EQ(rs[0].exit_code, 1) << describe(rs);
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "strobe: rank 0 of 2: distributed job failed: rank 1 stopped responding"), 1)
      << describe(rs);
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "strobe:"), 1) << describe(rs);
  EXPECT_LT(rs[0].seconds, 4.0 + 3.0) << describe(rs);
}

TEST(DDP, DeadStoreHostEndsTheOtherRanks) {
  const std::string dir = test_dir("host");
  auto rs = st::run_ranks(kWorld, [&](int rank) {
    auto strategy = sd::make_strategy(cpu_options(milliseconds(4000)));
    if (rank == 0) std::raise(SIGKILL);
    strategy->barrier("never reached by rank 0");
    return 0;
  }, dir, std::chrono::seconds(60), st::install_store_backend);
  EXPECT_EQ(rs[1].exit_code, 1) << describe(rs);
  EXPECT_EQ(count_lines_with(rs[1].stderr_text, "strobe: rank 1 of 2: distributed job failed: lost the rendezvous store at 127.0.0.1"), 1)
      << describe(rs);
  EXPECT_LT(rs[1].seconds, 4.0 + 3.0) << describe(rs);
}

TEST(DDP, FailingRankAbortsTheOthersWithItsReason) {
  const std::string dir = test_dir("abort");
  auto rs = st::run_ranks(kWorld, [&](int rank) {
    auto strategy = sd::make_strategy(cpu_options(milliseconds(20000)));
    if (rank == 1) {
      strategy->abort("CUDA out of memory (simulated)");
      return 1;
    }
    strategy->barrier("rank 1 never arrives");
    return 0;
  }, dir, std::chrono::seconds(60), st::install_store_backend);
  EXPECT_EQ(rs[0].exit_code, 1) << describe(rs);
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "distributed job failed: rank 1 failed: CUDA out of memory (simulated)"), 1)
      << describe(rs);
  EXPECT_LT(rs[0].seconds, 10.0) << describe(rs);  // far below the 20 s timeout: no waiting it out
}

TEST(DDP, RendezvousThatNeverCompletesFailsWithinTheTimeout) {
  const std::string dir = test_dir("rdzv");
  // Only one of two ranks starts (rank 0 hosts the store; then, alone, rank 1 finds no store).
  for (int alone : {0, 1}) {
    auto rs = st::run_ranks(1, [&](int) {
      ::setenv("WORLD_SIZE", "2", 1);
      ::setenv("RANK", std::to_string(alone).c_str(), 1);
      try {
        sd::make_strategy(cpu_options(milliseconds(2000)));
      } catch (const sd::DistributedError& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 7;
      }
      return 0;
    }, dir, std::chrono::seconds(60), st::install_store_backend);
    EXPECT_EQ(rs[0].exit_code, 7) << describe(rs);
    EXPECT_EQ(count_lines_with(rs[0].stderr_text, "rank " + std::to_string(alone) +
                                                      " of 2 (env launch): the rendezvous at 127.0.0.1:"),
              1)
        << describe(rs);
    EXPECT_EQ(count_lines_with(rs[0].stderr_text, "did not complete within trainer.dist_timeout (2 s)"), 1) << describe(rs);
    // A client that finds no store retries once after c10d's randomized backoff (up to about the
    // timeout again): the bound is twice the timeout, plus slack for a loaded CI machine.
    EXPECT_LT(rs[0].seconds, 2 * 2.0 + 3.0) << describe(rs);
  }
}

TEST(DDP, OneProcessGetsTheSingleDeviceStrategy) {
  sd::LaunchEnv env;
  auto s = sd::make_strategy(cpu_options(), env);
  EXPECT_EQ(s->world_size(), 1);
  EXPECT_TRUE(s->is_global_zero());
  EXPECT_EQ(s->process_group(), nullptr);
  EXPECT_EQ(s->device(), torch::Device(torch::kCPU));
  auto flag = torch::tensor(1.0f);
  EXPECT_TRUE(s->reduce_max(flag, sd::CollectiveKind::kLossAgreement).is_same(flag));
  EXPECT_TRUE(s->any(true));
  EXPECT_FALSE(s->any(false));
  EXPECT_EQ(s->broadcast_string("a"), "a");
}

TEST(DDP, DeviceChoicePerRank) {
  sd::LaunchEnv env;
  env.rank = 1;
  env.world_size = 2;
  env.local_rank = 1;
  if (!torch::cuda::is_available()) {
    EXPECT_EQ(sd::resolve_device("auto", env), torch::Device(torch::kCPU));
    EXPECT_THROW(sd::resolve_device("cuda", env), strobe::config::ConfigError);
  } else if (torch::cuda::device_count() >= 2) {
    EXPECT_EQ(sd::resolve_device("auto", env), torch::Device(torch::kCUDA, 1));
    EXPECT_EQ(sd::resolve_device("cuda", env), torch::Device(torch::kCUDA, 1));
  }
  EXPECT_EQ(sd::resolve_device("cpu", env), torch::Device(torch::kCPU));
  EXPECT_THROW(sd::resolve_device("tpu:0", env), strobe::config::ConfigError);
  if (torch::cuda::is_available()) EXPECT_THROW(sd::resolve_device("cuda:0", env), strobe::config::ConfigError);
}

TEST(DDP, CpuProcessGroupIsRefusedWithoutTheTestBackend) {
  sd::set_cpu_backend_factory(nullptr);
  sd::LaunchEnv env;
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = st::free_port();
  try {
    sd::make_strategy(cpu_options(milliseconds(1000)), env);
    FAIL() << "expected a ConfigError";
  } catch (const strobe::config::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("multi-process training runs on CUDA (NCCL)"), std::string::npos) << e.what();
  }
}
