#include "strobe/distributed/health_monitor.h"

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <c10/util/Exception.h>

namespace strobe::distributed::detail {

std::string short_error(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

bool is_collective_error(const std::exception& e) { return dynamic_cast<const c10::DistError*>(&e) != nullptr; }

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

double seconds(milliseconds d) { return std::chrono::duration<double>(d).count(); }

[[noreturn]] void fail_now(int64_t rank, int64_t world, const std::string& why, const char* how) {
  // The monitor thread and the main thread may both find the failure: the first one reports it.
  static std::mutex once;
  once.lock();
  std::fflush(stdout);
  std::fprintf(stderr, "strobe: rank %lld of %lld: distributed job %s: %s\n", static_cast<long long>(rank),
               static_cast<long long>(world), how, why.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

std::string lost_store_message(const std::string& address, const std::exception& e) {
  return fmt::format("lost the rendezvous store at {} ({}): its host (rank 0 or the launcher) is gone", address,
                     one_line(short_error(e)));
}

namespace {
template <class T>
void put(std::vector<uint8_t>& out, T v) {
  const auto* b = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), b, b + sizeof v);
}
template <class T>
T take(const std::vector<uint8_t>& in, size_t& at) {
  T v{};
  std::memcpy(&v, in.data() + at, sizeof v);
  at += sizeof v;
  return v;
}
constexpr size_t kHeartbeatBytes = 8 + 8 + 8 + 8 + 8 + 1;
}  // namespace

std::vector<uint8_t> encode_heartbeat(uint64_t beat, const CollectiveEntry& latest) {
  std::vector<uint8_t> out;
  out.reserve(kHeartbeatBytes);
  put(out, beat);
  put(out, latest.seq);
  put(out, latest.bytes);
  put(out, latest.issued_ns);
  put(out, latest.returned_ns);
  put(out, static_cast<uint8_t>(latest.kind));
  return out;
}

bool is_beat(const std::vector<uint8_t>& value) { return value.size() == kHeartbeatBytes; }

CollectiveEntry decode_heartbeat(const std::vector<uint8_t>& value) {
  CollectiveEntry e;
  if (value.size() != kHeartbeatBytes) return e;
  size_t at = 8;
  e.seq = take<int64_t>(value, at);
  e.bytes = take<int64_t>(value, at);
  e.issued_ns = take<int64_t>(value, at);
  e.returned_ns = take<int64_t>(value, at);
  const auto kind = take<uint8_t>(value, at);
  e.kind = kind < static_cast<uint8_t>(CollectiveKind::kCount) ? static_cast<CollectiveKind>(kind) : CollectiveKind::kNone;
  return e;
}

std::string abort_read_key(int64_t rank) { return "abort_read/" + std::to_string(rank); }

void wait_until_the_others_read_the_reason(c10d::Store& store, int64_t rank, int64_t world, milliseconds limit,
                                           int64_t dead) {
  std::vector<int64_t> waiting;
  for (int64_t r = 0; r < world; ++r)
    if (r != rank && r != dead) waiting.push_back(r);
  const auto until = Clock::now() + limit;
  try {
    while (!waiting.empty() && Clock::now() < until) {
      waiting.erase(std::remove_if(waiting.begin(), waiting.end(),
                                   [&](int64_t r) {
                                     return store.check({abort_read_key(r)}) || store.check({"done/" + std::to_string(r)});
                                   }),
                    waiting.end());
      if (!waiting.empty()) std::this_thread::sleep_for(milliseconds(20));
    }
  } catch (const std::exception&) {
    // The store is gone: nobody can read it any more.
  }
}

}  // namespace strobe::distributed::detail
