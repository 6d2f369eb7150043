// Two ranks in one process (two threads): metrics synced across ranks equal the metrics computed on
// the union of both ranks' data. Runs over ProcessGroupGloo when the Gloo headers are available
// (the torch wheel ships c10d's headers but not gloo's), and always over an in-process group that
// implements allreduce/allgather with a barrier, which checks the sync logic itself.
#include "strobe/metrics/aggregation.h"
#include "strobe/metrics/classification.h"
#include "strobe/metrics/detection.h"
#include "strobe/metrics/language.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#if __has_include(<gloo/config.h>)
#define STROBE_TEST_GLOO 1
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace sm = strobe::metrics;

namespace {

// Collectives through shared memory between threads; every call is a rendezvous of all ranks.
class Hub {
 public:
  explicit Hub(int world) : world_(world), slots_(world) {}
  int world() const { return world_; }
  // Deposits `t`, waits for every rank, returns all deposits (in rank order).
  std::vector<torch::Tensor> exchange(int rank, const torch::Tensor& t) {
    std::unique_lock<std::mutex> lock(mutex_);
    slots_[rank] = t.clone();
    arrive(lock);
    auto all = slots_;
    arrive(lock);  // nobody overwrites a slot before everyone has read it
    return all;
  }

 private:
  void arrive(std::unique_lock<std::mutex>& lock) {
    const int gen = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
  }
  int world_;
  std::vector<torch::Tensor> slots_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int generation_ = 0;
};

class ThreadGroup : public c10d::ProcessGroup {
 public:
  ThreadGroup(std::shared_ptr<Hub> hub, int rank) : c10d::ProcessGroup(rank, hub->world()), hub_(std::move(hub)) {}

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<torch::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    for (auto& t : tensors) {
      auto all = hub_->exchange(getRank(), t);
      auto acc = all[0].clone();
      for (size_t r = 1; r < all.size(); ++r) {
        if (opts.reduceOp == c10d::ReduceOp::SUM) acc.add_(all[r]);
        else if (opts.reduceOp == c10d::ReduceOp::MIN) acc = torch::minimum(acc, all[r]);
        else if (opts.reduceOp == c10d::ReduceOp::MAX) acc = torch::maximum(acc, all[r]);
        else TORCH_CHECK(false, "unsupported reduce op");
      }
      t.copy_(acc);
    }
    return done();
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<torch::Tensor>>& outputs,
                                           std::vector<torch::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    auto all = hub_->exchange(getRank(), inputs[0]);
    for (size_t r = 0; r < all.size(); ++r) outputs[0][r].copy_(all[r]);
    return done();
  }

 private:
  // The collectives above completed synchronously: hand back an already finished Work.
  struct DoneWork : c10d::Work {
    DoneWork() { finish(); }
  };
  static c10::intrusive_ptr<c10d::Work> done() { return c10::make_intrusive<DoneWork>(); }
  std::shared_ptr<Hub> hub_;
};

struct RankData {
  torch::Tensor scores, labels, values, weights, pred_boxes, target_boxes, logits, tokens;
};

RankData make_data(int64_t seed, int64_t n) {
  torch::manual_seed(seed);
  RankData d;
  d.scores = torch::randn({n, 6});
  d.labels = torch::randint(0, 5, {n});  // class 5 never a target
  d.values = torch::randn({n}) + seed;
  d.weights = torch::rand({n});
  d.pred_boxes = torch::rand({n, 4, 4}).cumsum(-1);
  d.target_boxes = torch::rand({n, 4, 4}).cumsum(-1);
  d.target_boxes.select(-1, 3).masked_fill_(torch::rand({n, 4}) < 0.3, 0.0);  // padding
  d.logits = torch::randn({n, 3, 9});
  d.tokens = torch::randint(-1, 9, {n, 3});
  return d;
}

using MetricFactory = std::function<std::unique_ptr<sm::Metric>()>;

struct Case {
  std::string name;
  MetricFactory make;
  std::function<void(sm::Metric&, const RankData&)> feed;
};

std::vector<Case> cases() {
  sm::MetricOptions cls;
  cls.num_classes = 6;
  cls.average = sm::Average::kMacro;
  sm::MetricOptions cls_w = cls;
  cls_w.average = sm::Average::kWeighted;
  cls_w.top_k = 2;
  sm::MetricOptions cat;
  cat.capacity = 64;
  sm::MetricOptions lm;
  lm.ignore_index = -1;
  auto scores = [](sm::Metric& m, const RankData& d) { m.update(d.scores, d.labels); };
  return {
      {"accuracy_macro", [=] { return std::make_unique<sm::Accuracy>(cls); }, scores},
      {"f1_weighted_top2", [=] { return std::make_unique<sm::F1Score>(cls_w); }, scores},
      {"precision_macro", [=] { return std::make_unique<sm::Precision>(cls); }, scores},
      {"mean", [] { return std::make_unique<sm::MeanMetric>(); },
       [](sm::Metric& m, const RankData& d) { m.update(d.values, d.weights); }},
      {"sum", [] { return std::make_unique<sm::SumMetric>(); }, [](sm::Metric& m, const RankData& d) { m.update(d.values); }},
      {"min", [] { return std::make_unique<sm::MinMetric>(); }, [](sm::Metric& m, const RankData& d) { m.update(d.values); }},
      {"max", [] { return std::make_unique<sm::MaxMetric>(); }, [](sm::Metric& m, const RankData& d) { m.update(d.values); }},
      {"cat", [=] { return std::make_unique<sm::CatMetric>(cat); }, [](sm::Metric& m, const RankData& d) { m.update(d.values); }},
      {"mean_giou", [] { return std::make_unique<sm::MeanGIoU>(); },
       [](sm::Metric& m, const RankData& d) { m.update(d.pred_boxes, d.target_boxes); }},
      {"perplexity", [=] { return std::make_unique<sm::Perplexity>(lm); },
       [](sm::Metric& m, const RankData& d) { m.update(d.logits, d.tokens); }},
      {"token_accuracy", [=] { return std::make_unique<sm::TokenAccuracy>(lm); },
       [](sm::Metric& m, const RankData& d) { m.update(d.logits, d.tokens); }},
  };
}

// Rank r's metrics see its own data only; after sync they must equal one metric fed both ranks'
// data (rank 0's first, which matters for CatMetric's order); after unsync, the local values.
void check_two_ranks(const std::function<c10::intrusive_ptr<c10d::ProcessGroup>(int)>& make_group) {
  const std::vector<RankData> data{make_data(0, 24), make_data(1, 17)};
  for (const auto& c : cases()) {
    std::vector<torch::Tensor> synced(2), local(2), unsynced(2);
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          auto group = make_group(rank);
          auto m = c.make();
          c.feed(*m, data[rank]);
          local[rank] = m->compute();
          m->sync(*group);
          synced[rank] = m->compute();
          m->unsync();
          unsynced[rank] = m->compute();
        } catch (const std::exception& e) {
          errors[rank] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_EQ(errors[0] + errors[1], "") << c.name;
    auto reference = c.make();
    c.feed(*reference, data[0]);
    c.feed(*reference, data[1]);
    const auto expected = reference->compute();
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_TRUE(torch::allclose(synced[rank], expected, 1e-5, 1e-6, /*equal_nan=*/true))
          << c.name << " rank " << rank << ": synced " << synced[rank] << " vs union " << expected;
      EXPECT_TRUE(torch::equal(unsynced[rank].nan_to_num(-7), local[rank].nan_to_num(-7))) << c.name;
    }
  }
}

}  // namespace

TEST(MetricSync, TwoRanksInProcessGroupEqualTheUnionOfTheirData) {
  auto hub = std::make_shared<Hub>(2);
  check_two_ranks([&](int rank) { return c10::make_intrusive<ThreadGroup>(hub, rank); });
}

TEST(MetricSync, TwoRanksOverGlooEqualTheUnionOfTheirData) {
#ifdef STROBE_TEST_GLOO
  auto store = c10::make_intrusive<c10d::HashStore>();
  check_two_ranks([&](int rank) -> c10::intrusive_ptr<c10d::ProcessGroup> {
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, options);
    auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, 2);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
    return group;
  });
#else
  GTEST_SKIP() << "gloo headers (gloo/config.h) not on the include path: the torch wheel ships c10d's "
                  "ProcessGroupGloo.hpp but not gloo's own headers";
#endif
}

TEST(MetricSync, ResyncStartsFromTheLocalState) {
  auto hub = std::make_shared<Hub>(2);
  std::vector<float> results(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      auto group = c10::make_intrusive<ThreadGroup>(hub, rank);
      sm::SumMetric s;
      s.update(torch::tensor({rank + 1.0}));
      s.sync(*group);
      s.sync(*group);  // must not count the other rank twice
      results[rank] = s.compute().item<float>();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(results[0], 3.0f);
  EXPECT_EQ(results[1], 3.0f);
}
