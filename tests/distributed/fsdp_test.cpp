// Fully sharded units (strobe/distributed/fsdp.h) across real processes on 127.0.0.1 with the
// store-backed test double: a unit keeps 1/world of its rows, gathers for the forward and again for
// the backward, frees after each, and the block computes what it computes unsharded, bitwise.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#include "strobe/core/activation_checkpoint.h"
#include "strobe/distributed/fsdp.h"
#include "strobe/distributed/strategy.h"
#include "tests/distributed/multiprocess.h"
#include "tests/distributed/store_backend.h"
#include "tests/test_dirs.h"

namespace sd = strobe::distributed;
namespace st = strobe::testing;

namespace fsdp_test {

void seed(uint64_t s) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(s);
}

// A residual block whose parameter shapes divide by neither 2 nor 3 ranks, with a 0-d gain.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    a = register_module("a", torch::nn::Linear(10, 13));
    b = register_module("b", torch::nn::Linear(13, 10));
    gain = register_parameter("gain", torch::tensor(0.75));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + b(torch::tanh(a(x))) * gain; }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor gain;
};
TORCH_MODULE(Block);

std::vector<Block> make_blocks(uint64_t s) {
  seed(s);
  return {Block(), Block(), Block()};
}

torch::Tensor input_of(int rank) {
  seed(500 + rank);
  return torch::randn({5, 10});
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// One rank: the blocks under units (reshard_after_forward as given) against the same blocks
// unsharded, on this rank's input. Throws on the first difference. `checkpointed`: the blocks run
// as the models run them (run_model_block, their units attached), blocks 0 and 2 with activation
// checkpointing (every_k 2) and block 1 without.
int run_rank(int rank, int world, bool reshard, bool checkpointed = false) {
  torch::set_num_threads(1);
  sd::StrategyOptions o;
  o.device = "cpu";
  auto strategy = sd::make_strategy(o);
  auto pg = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(strategy->process_group());
  auto blocks = make_blocks(7), reference = make_blocks(7);
  auto group = std::make_shared<sd::FsdpUnitGroup>();
  std::vector<std::unique_ptr<sd::FsdpUnit>> units;
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (auto& item : blocks[i]->named_parameters()) named.emplace_back(item.key(), item.value());
    units.push_back(std::make_unique<sd::FsdpUnit>(pg, rank, world, "block" + std::to_string(i), named,
                                                   sd::FsdpUnitOptions{reshard}, group));
  }
  strobe::ActivationCheckpointing ac;
  if (checkpointed) {
    ac.mode = strobe::ActivationCheckpointing::Mode::kEveryK;
    ac.every = 2;
    for (size_t i = 0; i < blocks.size(); ++i) sd::attach_unit(*blocks[i], units[i].get());
  }
  // Sharded: no parameter holds its data; each rank's rows are its chunk of the whole, zero-padded.
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto ref = reference[i]->parameters();
    const auto& u = *units[i];
    for (size_t k = 0; k < ref.size(); ++k) {
      require(u.params()[k].storage().nbytes() == 0, u.param_names()[k] + " still holds its data after sharding");
      const int64_t dim0 = ref[k].dim() ? ref[k].size(0) : 1, rows = u.rows(k);
      const int64_t first = std::min(dim0, rank * rows), n = std::min(dim0, (rank + 1) * rows) - first;
      auto shard = u.shard_of(k).reshape({rows, -1});
      auto whole = ref[k].detach().reshape({dim0, -1});
      require(torch::equal(shard.narrow(0, 0, n), whole.narrow(0, first, n)), u.param_names()[k] + ": shard rows differ");
      require(shard.narrow(0, n, rows - n).eq(0).all().item<bool>(), u.param_names()[k] + ": padding is not zero");
    }
  }
  const auto x = input_of(rank);
  const int64_t gathers0 = st::store_backend_allgather_calls();
  torch::Tensor h = x;
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto block = blocks[i];
    auto fn = [block](const std::vector<torch::Tensor>& t) mutable { return std::vector<torch::Tensor>{block->forward(t[0])}; };
    h = checkpointed ? strobe::run_model_block(ac, static_cast<int64_t>(i), *blocks[i], {h}, fn, /*preserve_rng=*/false)[0]
                     : sd::run_unit(*units[i], {h}, fn)[0];
    require(units[i]->gathered() == !reshard, "after its forward, block " + std::to_string(i) + (reshard ? " is still gathered" : " was freed"));
    require((units[i]->params()[0].storage().nbytes() == 0) == reshard, "the storage does not follow gathered()");
    if (i + 1 < blocks.size())  // prefetched: the next unit's all-gather was issued when this one ran
      require(units[i + 1]->in_flight(), "block " + std::to_string(i + 1) + "'s gather was not issued ahead");
  }
  const auto loss = h.square().sum();
  require(st::store_backend_allgather_calls() - gathers0 == 3, "the forward did not gather each unit once");
  loss.backward();  // a version-counter bump by the copy-out would throw here (saved tensors modified in place)
  const int64_t gathers = st::store_backend_allgather_calls() - gathers0;
  require(gathers == (reshard ? 6 : 3), "forward + backward issued " + std::to_string(gathers) + " unit all-gathers");
  for (auto& u : units) require(!u->gathered() && u->params()[0].storage().nbytes() == 0, u->name() + " is gathered after the backward");

  torch::Tensor r = x;
  for (auto& b : reference) r = b->forward(r);
  const auto ref_loss = r.square().sum();
  ref_loss.backward();
  require(torch::equal(loss, ref_loss), "loss " + std::to_string(loss.item<double>()) + " vs " + std::to_string(ref_loss.item<double>()));
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto got = blocks[i]->named_parameters(), want = reference[i]->named_parameters();
    for (size_t k = 0; k < got.size(); ++k)
      require(torch::equal(got[k].value().grad(), want[k].value().grad()),
              "block " + std::to_string(i) + " " + got[k].key() + ": gradient differs from the unsharded block's");
  }
  // Without gradients a unit is freed after its forward even when it keeps its parameters for a
  // backward; gathered, the parameters are the unsharded values bitwise.
  {
    torch::NoGradGuard ng;
    auto block = blocks[0];
    auto y = sd::run_unit(*units[0], {x}, [block](const std::vector<torch::Tensor>& t) mutable {
      return std::vector<torch::Tensor>{block->forward(t[0])};
    })[0];
    require(!units[0]->gathered(), "a no-grad forward kept the unit gathered");
    require(torch::equal(y, reference[0]->forward(x)), "no-grad forward differs");
    for (auto& u : units) u->gather();
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto got = blocks[i]->parameters(), want = reference[i]->parameters();
      for (size_t k = 0; k < got.size(); ++k) require(torch::equal(got[k], want[k]), "gathered values differ");
    }
  }
  strategy->shutdown();
  return 0;
}

void run_world(int world, bool reshard, const std::string& tag, bool checkpointed = false) {
  const auto dir = st::empty_test_dir("strobe_fsdp_" + tag + "_" + std::to_string(::getpid())).string();
  auto rs = st::run_ranks(world, [&](int rank) { return run_rank(rank, world, reshard, checkpointed); }, dir,
                          std::chrono::seconds(60), st::install_store_backend);
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << st::describe(rs);
}

}  // namespace fsdp_test

TEST(FsdpUnit, GathersForForwardAndBackwardFreesAfterEachAndMatchesUnshardedBlocksOnTwoRanks) {
  fsdp_test::run_world(2, /*reshard=*/true, "w2");
}

TEST(FsdpUnit, OnThreeRanksPaddedRowsAndKeptForBackwardWithoutReshard) {
  fsdp_test::run_world(3, /*reshard=*/false, "w3");
}

// Activation checkpointing inside the unit: the forward gathers, runs without the graph and frees;
// the backward gathers, recomputes and frees. Same gathers, same gradients, bitwise.
TEST(FsdpUnit, WithActivationCheckpointingGathersRecomputesAndFreesWithTheSameGradients) {
  fsdp_test::run_world(2, /*reshard=*/true, "ac", /*checkpointed=*/true);
}

namespace fsdp_test {

// An embedding unit (backward_gathers false) before a block unit: the forward gathers both, the
// backward the block alone (the embedding is neither gathered nor prefetched for it), and the
// embedding's gradient, made on its freed storage, is the unsharded one's bitwise.
int embedding_rank(int rank, int world) {
  torch::set_num_threads(1);
  sd::StrategyOptions o;
  o.device = "cpu";
  auto strategy = sd::make_strategy(o);
  auto pg = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(strategy->process_group());
  seed(3);
  torch::nn::Embedding emb(17, 10), emb_ref(17, 10);
  emb_ref->weight.detach().copy_(emb->weight.detach());
  auto blocks = make_blocks(5), reference = make_blocks(5);
  auto group = std::make_shared<sd::FsdpUnitGroup>();
  sd::FsdpUnitOptions eo;
  eo.backward_gathers = false;
  sd::FsdpUnit eu(pg, rank, world, "embedding", {{"weight", emb->weight}}, eo, group);
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& item : blocks[0]->named_parameters()) named.emplace_back(item.key(), item.value());
  sd::FsdpUnit bu(pg, rank, world, "block", named, sd::FsdpUnitOptions{}, group);
  const auto ids = torch::arange(rank, rank + 5) % 17;
  const int64_t gathers0 = st::store_backend_allgather_calls();
  auto x = sd::run_unit(eu, {ids}, [&](const std::vector<torch::Tensor>& t) { return std::vector<torch::Tensor>{emb(t[0])}; })[0];
  auto block = blocks[0];
  auto h = sd::run_unit(bu, {x}, [block](const std::vector<torch::Tensor>& t) mutable { return std::vector<torch::Tensor>{block->forward(t[0])}; })[0];
  require(st::store_backend_allgather_calls() - gathers0 == 2, "the forward did not gather each unit once");
  h.square().sum().backward();
  require(st::store_backend_allgather_calls() - gathers0 == 3, "the backward gathered the embedding");
  require(!eu.gathered() && !bu.gathered() && emb->weight.storage().nbytes() == 0, "a unit is gathered after the backward");
  reference[0]->forward(emb_ref(ids)).square().sum().backward();
  require(torch::equal(emb->weight.grad(), emb_ref->weight.grad()), "the embedding's gradient differs from the unsharded one's");
  strategy->shutdown();
  return 0;
}

}  // namespace fsdp_test

TEST(FsdpUnit, AnEmbeddingIsNotGatheredForItsBackward) {
  const auto dir = st::empty_test_dir("strobe_fsdp_emb_" + std::to_string(::getpid())).string();
  auto rs = st::run_ranks(2, [](int rank) { return fsdp_test::embedding_rank(rank, 2); }, dir, std::chrono::seconds(60),
                          st::install_store_backend);
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << st::describe(rs);
}

namespace fsdp_test {

// Steps of AdamW on the fp32 shards, each rank its quarter... of the global batch, against one
// process on the union batch (the mean loss). Throws on a difference beyond reduction noise.
int train_rank(int rank, int world) {
  torch::set_num_threads(1);
  sd::StrategyOptions o;
  o.device = "cpu";
  auto strategy = sd::make_strategy(o);
  auto pg = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(strategy->process_group());
  constexpr int kSteps = 4, kPerRank = 3;
  auto blocks = make_blocks(11), reference = make_blocks(11);
  std::vector<sd::ShardedParam> sharded;
  for (size_t i = 0; i < blocks.size(); ++i)
    for (auto& item : blocks[i]->named_parameters())
      sharded.push_back({"b" + std::to_string(i) + "." + item.key(), item.value(), item.value()});
  sd::Zero2Shards z(pg, rank, world, sharded, /*bucket_bytes=*/1 << 20);
  auto group = std::make_shared<sd::FsdpUnitGroup>();
  std::vector<std::unique_ptr<sd::FsdpUnit>> units;
  std::vector<sd::FsdpUnit*> raw;
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (auto& item : blocks[i]->named_parameters()) named.emplace_back(item.key(), item.value());
    units.push_back(std::make_unique<sd::FsdpUnit>(pg, rank, world, "block" + std::to_string(i), named, sd::FsdpUnitOptions{}, group));
    raw.push_back(units.back().get());
  }
  z.bind_units(raw);
  for (auto& u : units)  // the optimizer's shards are the rows' one copy
    require(u->has_sources() && !u->shard().defined(), u->name() + " keeps a shard of its own beside the optimizer's");
  torch::optim::AdamW opt(z.shards(), torch::optim::AdamWOptions(0.01));
  torch::optim::AdamW ref_opt(
      [&] {
        std::vector<torch::Tensor> ps;
        for (auto& b : reference)
          for (auto& p : b->parameters()) ps.push_back(p);
        return ps;
      }(),
      torch::optim::AdamWOptions(0.01));
  for (int step = 0; step < kSteps; ++step) {
    seed(900 + step);
    const auto global = torch::randn({world * kPerRank, 10});
    const auto x = global.narrow(0, rank * kPerRank, kPerRank);
    const int64_t scatters0 = st::store_backend_reduce_scatter_calls();
    z.prepare_for_backward();
    torch::Tensor h = x;
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto block = blocks[i];
      h = sd::run_unit(*units[i], {h}, [block](const std::vector<torch::Tensor>& t) mutable {
        return std::vector<torch::Tensor>{block->forward(t[0])};
      })[0];
    }
    h.square().mean().backward();
    z.finish();
    require(st::store_backend_reduce_scatter_calls() - scatters0 == 3, "not one gradient reduce-scatter per unit");
    for (auto& b : blocks)
      for (auto& p : b->parameters()) require(!p.grad().defined(), "a parameter kept its whole gradient");
    for (auto& u : units) require(!u->gathered(), u->name() + " is gathered after the backward");
    opt.step();
    z.gather_params();  // into the units' shards: no collective
    z.release_grads();

    torch::Tensor r = global;
    for (auto& b : reference) r = b->forward(r);
    ref_opt.zero_grad();
    r.square().mean().backward();
    ref_opt.step();
  }
  for (auto& u : units) u->gather();
  double worst = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto got = blocks[i]->named_parameters(), want = reference[i]->named_parameters();
    for (size_t k = 0; k < got.size(); ++k) {
      const auto diff = (got[k].value() - want[k].value()).abs().max().item<double>();
      worst = std::max(worst, diff);
      require(torch::allclose(got[k].value(), want[k].value(), 1e-5, 1e-6),
              "block " + std::to_string(i) + " " + got[k].key() + " differs after " + std::to_string(kSteps) +
                  " steps by " + std::to_string(diff));
    }
  }
  std::fprintf(stderr, "rank %d of %d: worst difference %.3g\n", rank, world, worst);
  strategy->shutdown();
  return 0;
}

}  // namespace fsdp_test

// The gradients reduce-scattered per unit into the optimizer's fp32 shards, AdamW on the shards, the
// updated shards into the units: the parameters after 4 steps are one process's on the union batch.
TEST(FsdpUnit, AdamWOnShardsEndsWhereOneProcessEndsOnTheUnionBatchOnTwoThreeAndFourRanks) {
  for (int world : {2, 3, 4}) {
    const auto dir = st::empty_test_dir("strobe_fsdp_train" + std::to_string(world) + "_" + std::to_string(::getpid())).string();
    auto rs = st::run_ranks(world, [&](int rank) { return fsdp_test::train_rank(rank, world); }, dir,
                            std::chrono::seconds(60), st::install_store_backend);
    for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << "world " << world << ": " << st::describe(rs);
    std::cout << "world " << world << ": " << rs[0].stderr_text;
  }
}
