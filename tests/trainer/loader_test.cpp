// Loader and sampler: batches independent of num_workers and of a mid-epoch start; distributed
// shards disjoint and complete.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "strobe/data/loader.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::data;

namespace {
class NoisyDataset : public Dataset {
 public:
  int64_t size() const override { return 53; }
  Sample get(int64_t index, at::Generator& gen) const override {
    return {{"x", torch::randn({3}, gen) + static_cast<double>(index)}, {"i", torch::tensor(index)}};
  }
};

std::vector<Batch> epoch(int64_t workers, int64_t ep, int64_t first = 0) {
  LoaderOptions o;
  o.batch_size = 5;
  o.num_workers = workers;
  o.seed = 11;
  DataLoader loader(std::make_shared<NoisyDataset>(), stack_collate, o);
  loader.start(ep, first);
  std::vector<Batch> out;
  while (auto b = loader.next()) out.push_back(*b);
  return out;
}

bool same(const std::vector<Batch>& a, const std::vector<Batch>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i].at("x"), b[i].at("x")) || !torch::equal(a[i].at("i"), b[i].at("i"))) return false;
  return true;
}
}  // namespace

TEST(Loader, BatchesDoNotDependOnNumWorkers) {
  auto ref = epoch(0, 1);
  ASSERT_EQ(ref.size(), 11u);
  EXPECT_EQ(ref.back().batch_size(), 3);
  EXPECT_TRUE(same(ref, epoch(1, 1)));
  EXPECT_TRUE(same(ref, epoch(3, 1)));
}

TEST(Loader, EpochsShuffleDifferentlyAndCoverEverything) {
  auto a = epoch(2, 0), b = epoch(2, 1);
  EXPECT_FALSE(same(a, b));
  std::set<int64_t> seen;
  for (auto& batch : a)
    for (int64_t i = 0; i < batch.batch_size(); ++i) seen.insert(batch.at("i")[i].item<int64_t>());
  EXPECT_EQ(seen.size(), 53u);
}

TEST(Loader, MidEpochStartYieldsTheRemainingBatches) {
  auto full = epoch(2, 3);
  auto tail = epoch(2, 3, 4);
  ASSERT_EQ(tail.size(), full.size() - 4);
  EXPECT_TRUE(same(std::vector<Batch>(full.begin() + 4, full.end()), tail));
}

// A training loader (lookahead) goes on with the next epoch's first batches once every batch of the
// epoch is made or being made, within the prefetch bound: after the consumer takes epoch 0, epoch 1's
// samples are made before start(1), never more than the bound's batches of them, and start(1) takes
// them over. Every epoch's batches are those of a loader without workers: taken over (epochs 1 and
// 2), dropped by a start elsewhere (epoch 4 from its batch 2, then epoch 1 again). Without lookahead
// nothing is made between epochs.
TEST(Loader, ATrainingLoaderMakesTheNextEpochsFirstBatchesAheadAndTheyAreExact) {
  class Counting : public NoisyDataset {
   public:
    Sample get(int64_t index, at::Generator& gen) const override {
      ++*gets;
      return NoisyDataset::get(index, gen);
    }
    std::shared_ptr<std::atomic<int64_t>> gets = std::make_shared<std::atomic<int64_t>>(0);
  };
  auto wait_for = [](const std::atomic<int64_t>& n, int64_t want) {
    for (int i = 0; i < 500 && n.load() < want; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // and nothing more comes
    return n.load();
  };
  for (bool lookahead : {true, false}) {
    auto data = std::make_shared<Counting>();
    LoaderOptions o;
    o.batch_size = 5;
    o.num_workers = 2;
    o.prefetch_factor = 2;  // the bound: 4 batches made and not taken
    o.seed = 11;
    o.lookahead = lookahead;
    DataLoader loader(data, stack_collate, o);
    auto take = [&](int64_t ep, int64_t first) {
      loader.start(ep, first);
      std::vector<Batch> out;
      while (auto b = loader.next()) out.push_back(*b);
      return out;
    };
    EXPECT_TRUE(same(take(0, 0), epoch(0, 0)));
    const int64_t ahead = wait_for(*data->gets, lookahead ? 53 + 4 * 5 : 53) - 53;
    EXPECT_EQ(ahead, lookahead ? 4 * 5 : 0) << "samples of epoch 1 made before start(1)";
    EXPECT_TRUE(same(take(1, 0), epoch(0, 1)));
    EXPECT_TRUE(same(take(2, 0), epoch(0, 2)));
    EXPECT_TRUE(same(take(4, 2), epoch(0, 4, 2)));
    EXPECT_TRUE(same(take(1, 0), epoch(0, 1)));
  }
}

// Through a fit: a step slower than the loader (a callback sleeps 100 ms), so the workers are ahead
// when an epoch ends; the first batch of epochs 1 and 2 is then waiting for the step (input wait
// under 30 ms; up to 10.6 ms seen on a loaded 2-core CI machine), where a loader stopped at the
// epoch's end starts cold (94-103 ms, checked: one worker makes a whole batch of 32 images of
// 3 x 256 x 256 first; 22 ms at 128 x 128, too near the loaded machine's 10.6 ms).
TEST(Loader, AnEpochOfAFitStartsWithTheBatchesItsWorkersMadeAhead) {
  struct Waits : Callback {
    std::string name() const override { return "first_waits"; }
    std::map<int64_t, double> first_wait;  // epoch -> the input wait of its first batch
    void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch&, int64_t idx) override {
      if (idx == 0) first_wait[t.state().epoch] = t.last_input_wait_s();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  };
  auto waits = std::make_shared<Waits>();
  auto run = strobe::testing::make_run(strobe::testing::tiny_yaml(),
                                       {"trainer.max_epochs=3", "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=0",
                                        "model.in_features=196608", "data.image_size=256", "data.channels=3",
                                        "data.num_samples=192", "data.batch_size=32", "data.num_workers=2",
                                        "trainer.enable_checkpointing=false"},
                                       "", std::nullopt, {waits});
  ASSERT_EQ(run->trainer->fit(), 0);
  ASSERT_EQ(waits->first_wait.size(), 3u);
  EXPECT_LT(waits->first_wait.at(1), 0.030);
  EXPECT_LT(waits->first_wait.at(2), 0.030);
}

// A worker's error reaches the consumer at its batch's turn, after every batch before it, as without
// workers: the workers make later batches first here (the early ones are slow), so an error raised as
// soon as it happens would come before batches 0-2.
TEST(Loader, WorkerErrorsReachTheConsumerAtTheirBatchsTurn) {
  class Broken : public Dataset {
   public:
    int64_t size() const override { return 10; }
    Sample get(int64_t index, at::Generator&) const override {
      if (index < 2) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      if (index == 7) throw std::runtime_error("bad sample 7");
      return {{"x", torch::full({1}, static_cast<float>(index))}};
    }
  };
  for (int64_t workers : {0, 4}) {
    LoaderOptions o;
    o.batch_size = 2;
    o.num_workers = workers;
    o.prefetch_factor = 4;
    o.shuffle = false;
    DataLoader loader(std::make_shared<Broken>(), stack_collate, o);
    loader.start(0);
    std::vector<float> firsts;
    try {
      while (auto b = loader.next()) firsts.push_back(b->at("x")[0][0].item<float>());
      ADD_FAILURE() << "no error";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "bad sample 7");
    }
    EXPECT_EQ(firsts, (std::vector<float>{0, 2, 4})) << workers << " workers";
  }
}

// From an offset (a resume that changed the batch): the ranks together take the epoch's order after
// its first `offset` samples, rank r at positions offset + r, offset + r + W, ... (as a whole epoch is
// split), padded by wrapping within that rest (drop_last: false) or cut to a multiple of W; the
// counts match; an offset past the end leaves nothing.
namespace {
// Records how many threads a torch op may use while the loader makes its samples.
class ThreadsSeen : public Dataset {
 public:
  int64_t size() const override { return 16; }
  Sample get(int64_t index, at::Generator&) const override {
    const int n = at::get_num_threads();
    std::lock_guard<std::mutex> lock(seen->mu);
    seen->counts.push_back(n);
    return {{"i", torch::tensor(index)}};
  }
  struct Seen {
    std::mutex mu;
    std::vector<int> counts;
  };
  std::shared_ptr<Seen> seen = std::make_shared<Seen>();
};
}  // namespace

// A worker's torch ops run on one thread (the workers are the parallelism): without it each worker
// starts an OpenMP team of every core for each large op, 12 x 16 threads on a 16-core machine.
// The main thread keeps its own count.
TEST(Loader, WorkersRunTheirTorchOpsOnOneThreadAndLeaveTheMainThreadsCount) {
  at::set_num_threads(2);
  ASSERT_EQ(at::get_num_threads(), 2);
  auto data = std::make_shared<ThreadsSeen>();
  LoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 2;
  DataLoader loader(data, stack_collate, o);
  loader.start(0);
  int batches = 0;
  while (loader.next()) ++batches;
  loader.stop();
  EXPECT_EQ(batches, 4);
  ASSERT_EQ(data->seen->counts.size(), 16u);
  for (int n : data->seen->counts) EXPECT_EQ(n, 1);
  EXPECT_EQ(at::get_num_threads(), 2);
}

TEST(Sampler, FromAnOffsetTheRanksSplitTheRestOfTheOrder) {
  const std::vector<int64_t> order = DistributedSampler(53, SamplerOptions{true, false, 5, 0, 1}).indices(2);
  for (int64_t world : {1, 2, 3}) {
    for (bool drop_last : {false, true}) {
      for (int64_t offset : {0, 20, 51, 53, 60}) {
        const int64_t rest = std::max<int64_t>(0, 53 - offset);
        for (int64_t r = 0; r < world; ++r) {
          DistributedSampler s(53, SamplerOptions{true, drop_last, 5, r, world});
          const auto idx = s.indices(2, offset);
          std::vector<int64_t> want;
          const int64_t per = world == 1 ? rest : drop_last ? rest / world : (rest + world - 1) / world;
          for (int64_t k = 0; k < per; ++k) {
            const int64_t pos = r + k * world;  // within the rest, wrapped when padded
            want.push_back(order[offset + (rest > 0 ? pos % rest : 0)]);
          }
          EXPECT_EQ(idx, want) << "world " << world << " rank " << r << " drop_last " << drop_last << " offset " << offset;
          EXPECT_EQ(s.num_samples(2, offset), per);
        }
      }
    }
  }
}

TEST(Sampler, ShardsAreDisjointAndComplete) {
  for (int64_t world : {2, 3}) {
    std::vector<int64_t> all;
    for (int64_t r = 0; r < world; ++r) {
      DistributedSampler s(53, SamplerOptions{true, true, 5, r, world});
      auto idx = s.indices(2);
      EXPECT_EQ(static_cast<int64_t>(idx.size()), 53 / world);
      all.insert(all.end(), idx.begin(), idx.end());
    }
    std::set<int64_t> uniq(all.begin(), all.end());
    EXPECT_EQ(uniq.size(), all.size()) << "ranks overlap (drop_last)";
    std::set<int64_t> covered;
    for (int64_t r = 0; r < world; ++r) {
      DistributedSampler s(53, SamplerOptions{true, false, 5, r, world});
      auto idx = s.indices(2);
      EXPECT_EQ(static_cast<int64_t>(idx.size()), (53 + world - 1) / world);
      covered.insert(idx.begin(), idx.end());
    }
    EXPECT_EQ(covered.size(), 53u) << "ranks miss samples (padded)";
  }
}
