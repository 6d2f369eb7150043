// The liveness of a multi-process job (not installed): every rank's heartbeat on its own thread and
// store connection, the verdict when one stands still, and the one line a rank ends with
// (docs/DISTRIBUTED.md, "When a rank fails"). Used by the data-parallel strategy (ddp_strategy.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "strobe/distributed/collective_record.h"

namespace strobe::distributed::detail {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A c10 error's message without its backtrace; any other exception's what().
std::string short_error(const std::exception& e);
// c10d's errors: NCCL's "remote process exited or there was a network error", an aborted
// communicator, a store collective that failed.
bool is_collective_error(const std::exception& e);
// `s` with its newlines as spaces and no trailing blanks.
std::string one_line(std::string s);
double seconds(milliseconds d);
// The one line every rank prints when the job cannot go on, then the process ends at once: a peer
// blocked in a collective cannot be unblocked, and destructors of communicators may block too.
[[noreturn]] void fail_now(int64_t rank, int64_t world, const std::string& why, const char* how = "failed");
// The rendezvous store at `address` is gone, as one line.
std::string lost_store_message(const std::string& address, const std::exception& e);
// The key a rank's monitor sets once it has read the "abort" reason.
std::string abort_read_key(int64_t rank);
// After `rank` wrote the "abort" reason: waits (at most `limit`) until every other rank but `dead`
// (-1: none) has read it or had finished in order. The store may live in the writing process, and
// a peer that read it after that process ended would say it lost the store instead of the reason.
void wait_until_the_others_read_the_reason(c10d::Store& store, int64_t rank, int64_t world, milliseconds limit,
                                           int64_t dead = -1);

// A heartbeat's value: the beat count and the rank's latest collective (collective_record.h), so
// rank 0 learns every rank's progress from the keys it already watches.
std::vector<uint8_t> encode_heartbeat(uint64_t beat, const CollectiveEntry& latest);
// The collective a heartbeat published (seq 0 for a value without one).
CollectiveEntry decode_heartbeat(const std::vector<uint8_t>& value);
// A value a beat wrote (not the one a rank sets before its first beat).
bool is_beat(const std::vector<uint8_t>& value);

// Liveness of the job, on its own thread and its own store connection (the main thread may be
// blocked in a collective). Every rank bumps its heartbeat key, which carries its latest collective
// (`record`, when given); rank 0 watches all ranks, the others watch rank 0 and the "abort" key. A heartbeat that stands still longer than `stale_after` means a
// dead or frozen process: the watcher publishes the reason under "abort" and every rank ends with it.
class HealthMonitor {
 public:
  HealthMonitor(c10::intrusive_ptr<c10d::Store> store, int64_t rank, int64_t world, milliseconds timeout,
                std::string store_address, const CollectiveRecord* record = nullptr)
      : store_(std::move(store)), rank_(rank), world_(world), address_(std::move(store_address)), record_(record),
        published_(static_cast<size_t>(world)) {
    interval_ = std::clamp<milliseconds>(timeout / 20, milliseconds(100), milliseconds(1000));
    stale_after_ms_ = std::max<milliseconds>(3 * interval_, std::min<milliseconds>(timeout / 2, milliseconds(30000))).count();
    // Early enough that the report is out before a collective's own timeout (trainer.dist_timeout)
    // ends a waiting rank: rank 0 sees progress up to a beat late, detection takes up to a beat and
    // the others' lines up to 2 more.
    hang_after_ = timeout - std::max<milliseconds>(8 * interval_, timeout / 10);
    store_->set(hb_key(rank_), std::vector<uint8_t>{0});
  }
  ~HealthMonitor() { stop(); }

  void start() {
    for (int64_t r = 0; r < world_; ++r)
      if (r != rank_ && (rank_ == 0 || r == 0)) peers_.push_back({r, {}, Clock::now(), {}});
    thread_ = std::thread([this] { run(); });
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // From now on store errors are the expected end of the job, not a failure.
  void quiet() { quiet_ = true; }
  // Where each rank writes its record of collectives when the job hangs (the run directory; ""
  // for none).
  void set_record_dir(const std::string& dir) {
    std::lock_guard<std::mutex> lock(published_mutex_);
    record_dir_ = dir;
  }
  // The collectives' other record this rank's file carries (c10d's flight recorder under NCCL).
  void set_flight_recorder(std::function<std::string()> dump) {
    std::lock_guard<std::mutex> lock(published_mutex_);
    flight_recorder_ = std::move(dump);
  }
  // How long rank 0 lets the ranks' collectives stand still, diverged, before it calls a hang.
  milliseconds hang_after() const { return hang_after_; }
  milliseconds interval() const { return interval_; }
  // Rank 0: every rank's latest collective as its last heartbeat carried it (index: rank; its own
  // entry is left empty).
  std::vector<CollectiveEntry> published() const {
    std::lock_guard<std::mutex> lock(published_mutex_);
    return published_;
  }

  // A collective failed on this rank, so a peer's death is likely: from now on a heartbeat that stood
  // still for 3 beats names its rank. Waits up to 5 beats for a verdict (that one, or another rank's
  // reason under "abort"); once one is found this thread ends the process with it, so the wait goes
  // on until then. Returns when none came.
  void expect_a_verdict() {
    if (!thread_.joinable() || stopping_ || quiet_) return;
    stale_after_ms_ = (3 * interval_).count();
    {
      std::lock_guard<std::mutex> lock(published_mutex_);
      verdict_since_ = Clock::now();
    }
    diverged_now_ = true;  // rank 0: ranks whose collectives diverged are the verdict, without waiting
    const auto until = Clock::now() + 5 * interval_;
    while (Clock::now() < until || (verdict_ && Clock::now() < until + 5 * interval_))
      std::this_thread::sleep_for(milliseconds(20));
  }

 private:
  static std::string hb_key(int64_t r) { return "hb/" + std::to_string(r); }

  void run() {
    uint64_t beat = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (cv_.wait_for(lock, interval_, [&] { return stopping_.load(); })) return;
      }
      std::string why;
      try {
        ++beat;
        store_->set(hb_key(rank_), encode_heartbeat(beat, record_ ? record_->latest() : CollectiveEntry{}));
        if (store_->check({"abort"})) {
          auto v = store_->get("abort");
          why = std::string(v.begin(), v.end());
          // A hang (or diverged collectives) rank 0 found: this rank says where it stands, keeps its
          // record, then ends; rank 0's line comes last.
          const bool hang = why.rfind(kHangMarker, 0) == 0, diverged = why.rfind(kDivergedMarker, 0) == 0;
          const std::string status = hang || diverged ? end_with_record() : "";
          // Read: the rank that wrote it may end now (wait_until_the_others_read_the_reason).
          store_->set(abort_read_key(rank_), std::vector<uint8_t>{1});
          if (hang || diverged) {
            if (quiet_ || stopping_) return;
            fail_now(rank_, world_, status, hang ? "hung" : "failed");
          }
        } else {
          why = check_peers();
          if (!why.empty()) {
            verdict_ = true;
            store_->set("abort", std::vector<uint8_t>(why.begin(), why.end()));
            wait_until_the_others_read_the_reason(*store_, rank_, world_, 2 * interval_, stale_rank_);
            const bool hang = why.rfind(kHangMarker, 0) == 0, diverged = why.rfind(kDivergedMarker, 0) == 0;
            if (hang || diverged) {
              const std::string status = end_with_record();
              std::string dir;
              {
                std::lock_guard<std::mutex> lock(published_mutex_);
                dir = record_dir_;
              }
              const std::string files = dir.empty() ? std::string() : fmt::format("; each rank's record: {}/collectives_rank<r>.json", dir);
              if (quiet_ || stopping_) return;
              const size_t marker = std::string(hang ? kHangMarker : kDivergedMarker).size();
              fail_now(rank_, world_, fmt::format("{}; {}{}", why.substr(marker), status, files), hang ? "hung" : "failed");
            }
          }
        }
      } catch (const std::exception& e) {
        if (quiet_ || stopping_) return;
        why = lost_store_message(address_, e);
      }
      if (!why.empty() && !quiet_ && !stopping_) fail_now(rank_, world_, why);
    }
  }

  static constexpr const char* kHangMarker = "\x02hang\x02";
  static constexpr const char* kDivergedMarker = "\x02diverged\x02";

  // This rank's status line; its record goes to the run directory.
  std::string end_with_record() {
    if (!record_) return "this rank keeps no record of its collectives";
    const std::string status = collective_status(record_->latest(), now_ns());
    std::string dir;
    std::function<std::string()> dump;
    {
      std::lock_guard<std::mutex> lock(published_mutex_);
      dir = record_dir_;
      dump = flight_recorder_;
    }
    if (!dir.empty()) write_collectives_file(dir, rank_, world_, *record_, status, dump ? dump() : std::string());
    return status;
  }

  // Rank 0: when no rank's latest collective moved for hang_after() (at once after a collective
  // failed: expect_a_verdict) and they disagree, the verdict naming where they diverged.
  std::string check_progress(const Clock::time_point now) {
    if (!record_ || rank_ != 0) return {};
    std::vector<CollectiveEntry> latest;
    {
      std::lock_guard<std::mutex> lock(published_mutex_);
      latest = published_;
    }
    latest[0] = record_->latest();
    std::vector<int64_t> seqs;
    for (const auto& e : latest) seqs.push_back(e.seq);
    if (seqs != progress_seqs_) {
      progress_seqs_ = seqs;
      progress_at_ = now;
    }
    const bool waited = now - progress_at_ > hang_after_;
    if (!waited && !diverged_now_) return {};
    if (!waited) {  // after a failed collective: only what every rank published since then
      std::lock_guard<std::mutex> lock(published_mutex_);
      for (const auto& p : peers_)
        if (p.published_at <= verdict_since_) return {};
    }
    const std::string where = diverged_collectives(latest, *record_, /*gaps=*/waited);
    if (where.empty()) return {};
    for (int64_t r = 1; r < world_; ++r)
      if (store_->check({"done/" + std::to_string(r)})) return {};  // a rank finished in order
    if (!waited) return kDivergedMarker + fmt::format("the ranks' collectives diverged: {}", where);
    return kHangMarker + fmt::format("no rank's collectives moved for {:.1f} s: {}",
                                     std::chrono::duration<double>(now - progress_at_).count(), where);
  }

  std::string check_peers() {
    std::vector<std::string> keys;
    for (auto& p : peers_) keys.push_back(hb_key(p.rank));
    auto values = store_->multiGet(keys);
    const auto now = Clock::now();
    for (size_t i = 0; i < peers_.size(); ++i) {
      auto& p = peers_[i];
      if (values[i] != p.last) {
        if (is_beat(values[i])) {  // not the value set before the peer's first beat
          std::lock_guard<std::mutex> lock(published_mutex_);
          published_[static_cast<size_t>(p.rank)] = decode_heartbeat(values[i]);
          p.published_at = now;
        }
        p.last = values[i];
        p.changed = now;
        continue;
      }
      if (now - p.changed <= milliseconds(stale_after_ms_.load())) continue;
      if (store_->check({"done/" + std::to_string(p.rank)})) continue;  // finished in order
      stale_rank_ = p.rank;
      return fmt::format("rank {} stopped responding: no heartbeat for {:.1f} s (the process died or is frozen)", p.rank,
                         std::chrono::duration<double>(now - p.changed).count());
    }
    return check_progress(now);
  }

  struct Peer {
    int64_t rank;
    std::vector<uint8_t> last;
    Clock::time_point changed;
    Clock::time_point published_at{};  // its latest beat's collective reached published_
  };
  c10::intrusive_ptr<c10d::Store> store_;
  int64_t rank_, world_;
  std::string address_;
  const CollectiveRecord* record_;
  std::string record_dir_;  // under published_mutex_
  std::function<std::string()> flight_recorder_;  // under published_mutex_
  milliseconds hang_after_{};
  std::vector<int64_t> progress_seqs_;
  Clock::time_point progress_at_ = Clock::now();
  std::atomic<bool> diverged_now_{false};
  Clock::time_point verdict_since_;  // under published_mutex_
  mutable std::mutex published_mutex_;
  std::vector<CollectiveEntry> published_;
  milliseconds interval_{};
  std::atomic<int64_t> stale_after_ms_{0};  // lowered by expect_a_verdict() on the main thread
  std::atomic<bool> verdict_{false};
  int64_t stale_rank_ = -1;  // the peer check_peers found stale        // this thread found a dead or frozen peer and will end the process
  std::vector<Peer> peers_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> quiet_{false};
};

}  // namespace strobe::distributed::detail
