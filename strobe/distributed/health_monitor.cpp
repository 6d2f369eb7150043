#include "strobe/distributed/health_monitor.h"

#include <cstdio>
#include <cstdlib>

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

[[noreturn]] void fail_now(int64_t rank, int64_t world, const std::string& why) {
  // The monitor thread and the main thread may both find the failure: the first one reports it.
  static std::mutex once;
  once.lock();
  std::fflush(stdout);
  std::fprintf(stderr, "strobe: rank %lld of %lld: distributed job failed: %s\n", static_cast<long long>(rank),
               static_cast<long long>(world), why.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

std::string lost_store_message(const std::string& address, const std::exception& e) {
  return fmt::format("lost the rendezvous store at {} ({}): its host (rank 0 or the launcher) is gone", address,
                     one_line(short_error(e)));
}

}  // namespace strobe::distributed::detail
