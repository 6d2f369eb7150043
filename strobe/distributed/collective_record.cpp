#include "strobe/distributed/collective_record.h"

#include <algorithm>

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

}  // namespace strobe::distributed
