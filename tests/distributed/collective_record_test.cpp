// Strobe's record of the collectives a rank issues (strobe/distributed/collective_record.h): the
// ring keeps the last 256 in order, a host collective's return is noted, the heartbeat carries the
// latest one, and recording costs well under a microsecond (no allocation, no device work). On two
// ranks of the real strategy: every rank records the same kinds in the same order, and rank 0 reads
// rank 1's latest collective from its heartbeats.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "strobe/distributed/collective_record.h"
#include "strobe/distributed/health_monitor.h"
#include "strobe/distributed/nccl_backend.h"
#include "strobe/distributed/strategy.h"
#include "tests/distributed/multiprocess.h"
#include "tests/distributed/store_backend.h"
#include "tests/test_dirs.h"

namespace sd = strobe::distributed;
namespace st = strobe::testing;

namespace {

TEST(CollectiveRecord, KeepsTheLastEntriesInOrderAndNotesAHostReturn) {
  sd::CollectiveRecord r;
  EXPECT_EQ(r.latest().seq, 0);
  EXPECT_TRUE(r.last().empty());
  const int64_t first = r.issue(sd::CollectiveKind::kHostBarrier, 0);
  EXPECT_EQ(first, 1);
  EXPECT_EQ(r.latest().returned_ns, 0) << "still waiting";
  r.returned(first);
  EXPECT_GT(r.latest().returned_ns, 0);
  for (int i = 0; i < 299; ++i) r.issue(i % 2 ? sd::CollectiveKind::kReduceScatter : sd::CollectiveKind::kAllGather, i);
  EXPECT_EQ(r.latest().seq, 300);
  auto all = r.last();
  ASSERT_EQ(all.size(), sd::CollectiveRecord::kCapacity);
  EXPECT_EQ(all.front().seq, 300 - 256 + 1);
  for (size_t i = 1; i < all.size(); ++i) EXPECT_EQ(all[i].seq, all[i - 1].seq + 1);
  EXPECT_EQ(all.back().kind, sd::CollectiveKind::kAllGather);  // i = 298
  EXPECT_EQ(all.back().bytes, 298);
  r.returned(first);  // long gone from the ring: changes nothing
  EXPECT_EQ(r.last(3).front().seq, 298);
  EXPECT_STREQ(sd::collective_kind_name(sd::CollectiveKind::kReduceScatter), "gradient reduce-scatter");
  EXPECT_STREQ(sd::collective_kind_op(sd::CollectiveKind::kReduceScatter), "reduce_scatter");
  EXPECT_TRUE(sd::collective_kind_on_host(sd::CollectiveKind::kHostGather));
  EXPECT_FALSE(sd::collective_kind_on_host(sd::CollectiveKind::kMetricSync));
}

TEST(CollectiveRecord, AHeartbeatCarriesTheLatestCollective) {
  sd::CollectiveEntry e{41, sd::CollectiveKind::kStopAgreement, 4, 123456789, 0};
  const auto d = sd::detail::decode_heartbeat(sd::detail::encode_heartbeat(7, e));
  EXPECT_EQ(d.seq, 41);
  EXPECT_EQ(d.kind, sd::CollectiveKind::kStopAgreement);
  EXPECT_EQ(d.bytes, 4);
  EXPECT_EQ(d.issued_ns, 123456789);
  EXPECT_EQ(d.returned_ns, 0);
  EXPECT_EQ(sd::detail::decode_heartbeat({0}).seq, 0) << "the first beat, before any collective";
}

// Rank 0's reading of the ranks' latest collectives: agreement is no divergence; at one number the
// kind most ranks issued is the reference (3 ranks: rank 0 is the odd one); at different numbers a
// rank is compared with rank 0's own entry at its number, and only a hang (`gaps`) names the ranks
// that stood behind.
TEST(CollectiveRecord, RankZeroNamesWhereTheRanksDiverged) {
  using K = sd::CollectiveKind;
  sd::CollectiveRecord mine;  // rank 0: 1 stop agreement, 2 metric sync, 3 epoch sums
  mine.issue(K::kStopAgreement, 4);
  mine.issue(K::kMetricSync, 64);
  mine.issue(K::kEpochSums, 48);
  auto at = [](int64_t seq, K kind, int64_t bytes) { return sd::CollectiveEntry{seq, kind, bytes, 1, 0}; };
  EXPECT_EQ(sd::diverged_collectives({at(3, K::kEpochSums, 48), at(3, K::kEpochSums, 48)}, mine, true), "");
  EXPECT_EQ(sd::diverged_collectives({at(3, K::kEpochSums, 48), at(3, K::kMetricSync, 64), at(3, K::kMetricSync, 64)}, mine, false),
            "rank 0 issued epoch sums (all_reduce, 48 B) as collective 3 where rank 1 issued metric sync (all_reduce, 64 B)");
  // Rank 1 at 2 with another kind than rank 0's 2nd: diverged, hang or not.
  EXPECT_EQ(sd::diverged_collectives({at(3, K::kEpochSums, 48), at(2, K::kEpochSums, 48)}, mine, false),
            "rank 1 issued epoch sums (all_reduce, 48 B) as collective 2 where rank 0 issued metric sync (all_reduce, 64 B)");
  // Rank 1 behind with the same kinds: ranks out of step (not a divergence) unless they stood still.
  EXPECT_EQ(sd::diverged_collectives({at(3, K::kEpochSums, 48), at(2, K::kMetricSync, 64)}, mine, false), "");
  EXPECT_EQ(sd::diverged_collectives({at(3, K::kEpochSums, 48), at(2, K::kMetricSync, 64)}, mine, true),
            "rank 1 never reached collective 3, epoch sums (all_reduce, 48 B); its latest: collective 2, metric sync (all_reduce, 64 B)");
}

// The cost a step pays: issue() in a tight loop (one uncontended lock, a clock read, one slot).
TEST(CollectiveRecord, RecordingACollectiveCostsUnderAMicrosecond) {
  sd::CollectiveRecord r;
  constexpr int kN = 200000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kN; ++i) r.issue(sd::CollectiveKind::kReduceScatter, i);
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / kN;
  std::cout << "[ collective record ] " << ns << " ns per collective\n";
  EXPECT_LT(ns, 1000.0);
  EXPECT_EQ(r.latest().seq, kN);
}

// NCCL's own record (c10d's flight recorder) is read in this process as the JSON a rank's file
// carries under "nccl", with no process group yet: no entries (this build compiles the NCCL
// backend; the CUDA runs belong to the multi-GPU tests). A record's file carries it beside
// Strobe's own collectives.
TEST(CollectiveRecord, TheFileCarriesNcclsFlightRecorderBesideStrobesRecord) {
  const std::string dump = sd::nccl_flight_record_json();
  auto j = nlohmann::json::parse(dump, nullptr, false);
  ASSERT_TRUE(j.is_object()) << "dump: '" << dump << "'";
  EXPECT_TRUE(j.contains("version")) << dump;
  EXPECT_TRUE(j.value("entries", nlohmann::json::array()).empty()) << dump;
  const std::string dir = st::empty_test_dir("strobe_collective_file_" + std::to_string(::getpid())).string();
  sd::CollectiveRecord r;
  r.issue(sd::CollectiveKind::kMetricSync, 64);
  const std::string fake = R"({"version": "2.10", "entries": [{"collective_seq_id": 7, "profiling_name": "nccl:all_reduce",)"
                           R"( "state": "started", "input_sizes": [[16]], "is_p2p": false}]})";
  const std::string path = sd::write_collectives_file(dir, 1, 2, r, "this rank waits", fake);
  ASSERT_EQ(path, dir + "/collectives_rank1.json");
  std::ifstream in(path);
  auto f = nlohmann::json::parse(in);
  EXPECT_EQ(f["status"], "this rank waits");
  EXPECT_EQ(f["collectives"][0]["kind"], "metric sync");
  EXPECT_EQ(f["nccl"]["entries"][0]["collective_seq_id"], 7);
}

TEST(CollectiveRecord, TwoRanksRecordTheSameCollectivesAndRankZeroReadsRankOnesFromItsHeartbeat) {
  const std::string dir = st::empty_test_dir("strobe_collective_record_" + std::to_string(::getpid())).string();
  auto rs = st::run_ranks(2, [&](int rank) {
    torch::set_num_threads(1);
    sd::StrategyOptions o;
    o.device = "cpu";
    o.timeout = std::chrono::seconds(10);  // heartbeats every 0.5 s
    auto strategy = sd::make_strategy(o);
    torch::nn::Linear net(8, 2);  // no buffers: no buffer broadcast
    strategy->setup_model(*net);
    strategy->set_grad_sync(true);
    auto loss = net->forward(torch::randn({4, 8})).sum();
    strategy->pre_backward();
    loss.backward();
    strategy->finish_grad_sync();
    auto flag = torch::zeros({});
    strategy->reduce_max(flag, sd::CollectiveKind::kStopAgreement);
    strategy->barrier("recorded");
    std::this_thread::sleep_for(std::chrono::seconds(2));  // rank 0 sees rank 1's beats since the barrier
    const auto mine = strategy->collectives()->last();
    std::vector<sd::CollectiveKind> kinds;
    for (const auto& e : mine) kinds.push_back(e.kind);
    const std::vector<sd::CollectiveKind> want = {
        sd::CollectiveKind::kHostBarrier,        sd::CollectiveKind::kParamCheck,     sd::CollectiveKind::kSetupBroadcast,
        sd::CollectiveKind::kGradientAllReduce,  sd::CollectiveKind::kStopAgreement, sd::CollectiveKind::kHostBarrier};
    int rc = kinds == want ? 0 : 10;
    if (rc != 0)
      for (const auto& e : mine) std::fprintf(stderr, "rank %d: %lld %s\n", rank, static_cast<long long>(e.seq), sd::collective_kind_name(e.kind));
    if (mine.back().returned_ns == 0) rc = 11;  // the barrier returned
    if (rank == 0) {
      const auto seen = strategy->published_collectives();
      if (seen.size() != 2 || seen[1].seq != 6 || seen[1].kind != sd::CollectiveKind::kHostBarrier || seen[0].seq != 6) rc = 12;
      if (rc == 12) std::fprintf(stderr, "rank 0 read rank 1's latest as %lld\n", static_cast<long long>(seen.size() > 1 ? seen[1].seq : -1));
    }
    strategy->shutdown();
    return rc;
  }, dir, std::chrono::seconds(60), st::install_store_backend);
  for (auto& r : rs) EXPECT_EQ(r.exit_code, 0) << st::describe(rs);
}

}  // namespace
