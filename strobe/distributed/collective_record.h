// Strobe's own record of the collectives a rank issues (docs/DISTRIBUTED.md, "When a run hangs"):
// what each was (its kind), its sequence number on this rank, its size and when it was issued, and
// for the host-blocking ones (store decisions) when it returned. Every rank issues the same
// collectives in the same order, so sequence number k names the same collective on every rank: a
// rank whose record stops short of another's, or holds another kind at the same number, is where a
// run diverged.
//
// Always on, and cheap: issue() takes an uncontended mutex, reads the clock and writes one slot of a
// ring allocated once (no allocation, no device work, no host synchronization); a step issues a few
// to a few dozen. The health monitor publishes latest() with each heartbeat (health_monitor.h).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace strobe::distributed {

// What a collective is for. The order is the wire format of a published heartbeat: append only.
enum class CollectiveKind : uint8_t {
  kNone = 0,           // nothing issued yet
  kSetupBroadcast,     // setup: rank 0's parameters and buffers to every rank
  kParamCheck,         // setup: the parameters' shapes compared across ranks
  kGradientAllReduce,  // ddp: one backward's gradient all-reduce (c10d's Reducer issues its buckets)
  kBufferBroadcast,    // ddp and zero2: rank 0's buffers after a backward
  kReduceScatter,      // zero2: one bucket of gradients
  kAllGather,          // zero2: one bucket of updated parameters
  kMasterBroadcast,    // zero2 setup: rank 0's fp32 masters, one bucket
  kGradNorms,          // the per-parameter squared gradient norms (sum)
  kLossAgreement,      // the step's non-finite loss and gradient flags (max)
  kLossSum,            // the step's mean loss over ranks, for spike detection (sum)
  kStopAgreement,      // whether to stop, and with what status (max)
  kEpochSums,          // the logger's epoch sums (sum)
  kMetricSync,         // a metric collection's states
  kParamGather,        // zero2: one parameter's whole value for a checkpoint
  kUnitGather,         // fsdp: one unit's parameters, whole for its forward or backward (fsdp.h)
  kHostBroadcast,      // a host decision from rank 0 (the store)
  kHostGather,         // every rank's bytes to rank 0 (the store): a checkpoint's RNG states
  kHostAny,            // whether any rank says yes (the store)
  kHostBarrier,        // every rank at the same point (the store)
  kCount
};

// The collective's name as Strobe's messages and files write it ("gradient all-reduce").
const char* collective_kind_name(CollectiveKind kind);
// The operation it is ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "store").
const char* collective_kind_op(CollectiveKind kind);
// A host-blocking collective (through the rendezvous store): its record says when it returned.
bool collective_kind_on_host(CollectiveKind kind);

struct CollectiveEntry {
  int64_t seq = 0;  // 1, 2, ... on this rank; 0: none
  CollectiveKind kind = CollectiveKind::kNone;
  int64_t bytes = 0;
  int64_t issued_ns = 0;    // system clock, since the epoch
  // When the call that issued it returned to the host (0: the host is still inside it). A store
  // collective returns when every rank took part; NCCL's return once enqueued on the GPU's stream
  // (the GPU may wait in them after that); the test double's return when done.
  int64_t returned_ns = 0;
};

class CollectiveRecord {
 public:
  static constexpr size_t kCapacity = 256;  // the last this many are kept

  // Records a collective about to be issued; returns its sequence number.
  int64_t issue(CollectiveKind kind, int64_t bytes);
  // The call that issued collective `seq` returned.
  void returned(int64_t seq);

  // Tests only: STROBE_SKIP_COLLECTIVE=<kind name>@<rank>#<n> makes rank <rank> leave out the n-th
  // collective of that kind (a code path one rank skips: what a hang is made of). Counts the calls;
  // true when this one is to be left out (it is then not recorded). Unset (always, outside tests):
  // false.
  bool skips(CollectiveKind kind, int64_t rank);

  // The latest entry (seq 0 when none).
  CollectiveEntry latest() const;
  // The last `n` entries, oldest first (allocates: for a report, not for a step).
  std::vector<CollectiveEntry> last(size_t n = kCapacity) const;

 private:
  mutable std::mutex mutex_;
  std::array<CollectiveEntry, kCapacity> ring_{};
  int64_t seq_ = 0;
  std::array<int64_t, static_cast<size_t>(CollectiveKind::kCount)> calls_{};
};

int64_t now_ns();

// "collective 10 (metric sync, all_reduce, 64 B)".
std::string describe_collective(const CollectiveEntry& e);
// What this rank is doing in its collectives at `now`: "waits in collective 10 (...) for 7.5 s" when
// the host is inside the call, else "its latest collective: 10 (...), issued 7.5 s ago, returned".
std::string collective_status(const CollectiveEntry& latest, int64_t now);
// Rank 0's reading of every rank's latest collective (index: rank), with `mine`, rank 0's own record:
// "" when nothing shows a divergence, else which ranks diverged and where. A rank whose latest
// collective is of another kind than the one rank 0 (or, all at one number, most ranks) issued at
// that number: "rank 1 issued stop agreement (all_reduce, 4 B) as collective 10 where rank 0 issued
// metric sync (all_reduce)". With `gaps` (the ranks stood still), ranks behind the others: "rank 1
// never reached collective 10, metric sync (all_reduce); its latest: collective 9, ...".
std::string diverged_collectives(const std::vector<CollectiveEntry>& latest, const CollectiveRecord& mine, bool gaps);
// Writes `record` to <dir>/collectives_rank<rank>.json (checkpoint::write_file_atomic):
// the rank, the world size, `status` (the line the rank ended with) and its last collectives,
// oldest first; with `nccl_json` (c10d's flight recorder, nccl_backend.h) as "nccl". Returns the
// path ("" when it could not be written).
std::string write_collectives_file(const std::string& dir, int64_t rank, int64_t world, const CollectiveRecord& record,
                                   const std::string& status, const std::string& nccl_json = "");

}  // namespace strobe::distributed
