#include "strobe/distributed/collective_record.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "strobe/checkpoint/checkpoint_io.h"

namespace strobe::distributed {

namespace {

struct KindInfo {
  const char* name;
  const char* op;
};

constexpr KindInfo kKinds[] = {
    {"none", "none"},
    {"setup broadcast", "broadcast"},
    {"parameter check", "all_gather"},
    {"gradient all-reduce", "all_reduce"},
    {"buffer broadcast", "broadcast"},
    {"gradient reduce-scatter", "reduce_scatter"},
    {"parameter all-gather", "all_gather"},
    {"master broadcast", "broadcast"},
    {"gradient norms", "all_reduce"},
    {"loss agreement", "all_reduce"},
    {"spike loss mean", "all_reduce"},
    {"stop agreement", "all_reduce"},
    {"epoch sums", "all_reduce"},
    {"metric sync", "all_reduce"},
    {"checkpoint gather", "all_gather"},
    {"unit all-gather", "all_gather"},
    {"host broadcast", "store"},
    {"host gather", "store"},
    {"host any", "store"},
    {"host barrier", "store"},
};
static_assert(sizeof(kKinds) / sizeof(kKinds[0]) == static_cast<size_t>(CollectiveKind::kCount));

const KindInfo& info(CollectiveKind kind) {
  const auto i = static_cast<size_t>(kind);
  return kKinds[i < static_cast<size_t>(CollectiveKind::kCount) ? i : 0];
}

}  // namespace

const char* collective_kind_name(CollectiveKind kind) { return info(kind).name; }
const char* collective_kind_op(CollectiveKind kind) { return info(kind).op; }
bool collective_kind_on_host(CollectiveKind kind) { return kind >= CollectiveKind::kHostBroadcast && kind < CollectiveKind::kCount; }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int64_t CollectiveRecord::issue(CollectiveKind kind, int64_t bytes) {
  const int64_t t = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t seq = ++seq_;
  ring_[static_cast<size_t>(seq) % kCapacity] = CollectiveEntry{seq, kind, bytes, t, 0};
  return seq;
}

void CollectiveRecord::returned(int64_t seq) {
  const int64_t t = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  auto& e = ring_[static_cast<size_t>(seq) % kCapacity];
  if (e.seq == seq) e.returned_ns = t;
}

CollectiveEntry CollectiveRecord::latest() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return seq_ == 0 ? CollectiveEntry{} : ring_[static_cast<size_t>(seq_) % kCapacity];
}

std::vector<CollectiveEntry> CollectiveRecord::last(size_t n) const {
  std::lock_guard<std::mutex> lock(mutex_);
  n = std::min<size_t>({n, kCapacity, static_cast<size_t>(seq_)});
  std::vector<CollectiveEntry> out;
  out.reserve(n);
  for (int64_t s = seq_ - static_cast<int64_t>(n) + 1; s <= seq_; ++s) out.push_back(ring_[static_cast<size_t>(s) % kCapacity]);
  return out;
}

bool CollectiveRecord::skips(CollectiveKind kind, int64_t rank) {
  struct Spec {
    std::string kind;
    int64_t rank = -1, nth = 0;
  };
  static const Spec spec = [] {
    Spec s;
    const char* v = std::getenv("STROBE_SKIP_COLLECTIVE");
    if (!v) return s;
    const std::string text = v;
    const auto at = text.rfind('@'), hash = text.rfind('#');
    if (at == std::string::npos || hash == std::string::npos || hash < at) return s;
    s.kind = text.substr(0, at);
    s.rank = std::atoll(text.substr(at + 1, hash - at - 1).c_str());
    s.nth = std::atoll(text.substr(hash + 1).c_str());
    return s;
  }();
  if (spec.rank < 0 || spec.rank != rank || spec.kind != collective_kind_name(kind)) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  return ++calls_[static_cast<size_t>(kind)] == spec.nth;
}

namespace {
// "metric sync (all_reduce, 64 B)"; the size left out when not known.
std::string kind_and_size(const CollectiveEntry& e) {
  return e.bytes > 0 ? fmt::format("{} ({}, {} B)", collective_kind_name(e.kind), collective_kind_op(e.kind), e.bytes)
                     : fmt::format("{} ({})", collective_kind_name(e.kind), collective_kind_op(e.kind));
}
}  // namespace

std::string describe_collective(const CollectiveEntry& e) {
  if (e.seq == 0) return "no collective yet";
  return fmt::format("collective {}, {}", e.seq, kind_and_size(e));
}

std::string collective_status(const CollectiveEntry& e, int64_t now) {
  if (e.seq == 0) return "this rank has issued no collective";
  const double since = static_cast<double>(now - e.issued_ns) / 1e9;
  if (e.returned_ns == 0) return fmt::format("this rank waits in {} for {:.1f} s", describe_collective(e), since);
  return fmt::format("this rank is not inside a collective call; its latest: {}, issued {:.1f} s ago", describe_collective(e),
                     since);
}

std::string diverged_collectives(const std::vector<CollectiveEntry>& latest, const CollectiveRecord& mine, bool gaps) {
  if (latest.empty()) return "";
  int64_t lo = latest[0].seq, hi = latest[0].seq;
  for (const auto& e : latest) lo = std::min(lo, e.seq), hi = std::max(hi, e.seq);
  std::vector<std::string> parts;
  if (lo == hi) {
    // The same number everywhere: the kinds must agree; the kind most ranks issued (rank 0's on a
    // tie) is the one the others left out or added.
    std::map<CollectiveKind, int> votes;
    for (const auto& e : latest) ++votes[e.kind];
    if (votes.size() == 1) return "";
    CollectiveKind common = latest[0].kind;
    for (const auto& [k, n] : votes)
      if (n > votes[common]) common = k;
    size_t ref = 0;
    while (latest[ref].kind != common) ++ref;
    for (size_t r = 0; r < latest.size(); ++r)
      if (latest[r].kind != common)
        parts.push_back(fmt::format("rank {} issued {} as collective {} where rank {} issued {}", r, kind_and_size(latest[r]),
                                    latest[r].seq, ref, kind_and_size(latest[ref])));
    return fmt::format("{}", fmt::join(parts, "; "));
  }
  // Other numbers (ranks are not in step on the host): a rank whose latest collective is of another
  // kind than rank 0's own at that number diverged.
  const auto own = mine.last();
  for (size_t r = 1; r < latest.size(); ++r)
    for (const auto& m : own)
      if (latest[r].seq != 0 && m.seq == latest[r].seq && m.kind != latest[r].kind)
        parts.push_back(fmt::format("rank {} issued {} as collective {} where rank 0 issued {}", r, kind_and_size(latest[r]),
                                    m.seq, kind_and_size(m)));
  if (!parts.empty() || !gaps) return fmt::format("{}", fmt::join(parts, "; "));
  // Stood still apart: the ranks at `lo` never reached collective lo + 1; it is named from a record
  // that holds it.
  CollectiveEntry next;
  for (const auto& e : own)
    if (e.seq == lo + 1) next = e;
  for (const auto& e : latest)
    if (next.seq == 0 && e.seq == lo + 1) next = e;
  const std::string what = next.seq ? describe_collective(next) : fmt::format("collective {}", lo + 1);
  std::vector<std::string> behind;
  for (size_t r = 0; r < latest.size(); ++r)
    if (latest[r].seq == lo) behind.push_back(std::to_string(r));
  return fmt::format("{} {} never reached {}; {} latest: {}", behind.size() == 1 ? "rank" : "ranks", fmt::join(behind, ", "),
                     what, behind.size() == 1 ? "its" : "their",
                     lo == 0 ? std::string("none") : describe_collective(latest[std::stoul(behind[0])]));
}

std::string write_collectives_file(const std::string& dir, int64_t rank, int64_t world, const CollectiveRecord& record,
                                   const std::string& status, const std::string& nccl_json) {
  if (dir.empty()) return "";
  nlohmann::json j;
  j["rank"] = rank;
  j["world_size"] = world;
  j["written_ns"] = now_ns();
  j["status"] = status;
  auto& list = j["collectives"] = nlohmann::json::array();
  for (const auto& e : record.last())
    list.push_back({{"seq", e.seq},
                    {"kind", collective_kind_name(e.kind)},
                    {"op", collective_kind_op(e.kind)},
                    {"bytes", e.bytes},
                    {"issued_ns", e.issued_ns},
                    {"returned_ns", e.returned_ns}});
  if (!nccl_json.empty()) {
    auto nccl = nlohmann::json::parse(nccl_json, nullptr, false);
    if (!nccl.is_discarded()) j["nccl"] = std::move(nccl);
  }
  const std::string path = fmt::format("{}/collectives_rank{}.json", dir, rank);
  try {
    checkpoint::write_file_atomic(path, j.dump(1) + "\n");
  } catch (const std::exception&) {
    return "";  // the disk: the rank's line still says where it stood
  }
  return path;
}

}  // namespace strobe::distributed
