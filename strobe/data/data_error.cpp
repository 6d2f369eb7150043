#include "strobe/data/data_error.h"

#include "strobe/checkpoint/mapped_file.h"

#include <cstdio>

#include <fmt/format.h>

namespace strobe::data {

void require_regular_file(const std::string& path) {
  const std::string kind = checkpoint::non_regular_kind(path);
  if (!kind.empty()) throw DataError(fmt::format("{}: is {}, not a regular file", path, kind));
}

void BadSampleLog::bad(const std::string& key, const std::string& what) const {
  if (mode_ == OnBadSample::Error) throw DataError(what);
  std::lock_guard<std::mutex> lock(mu_);
  if (!seen_.insert(key).second) return;
  const int64_t n = ++count_;
  fmt::print(stderr, "strobe: data: {}: skipped {} ({} bad item{} skipped so far; on_bad_sample: skip)\n", dataset_, what, n,
             n == 1 ? "" : "s");
  std::fflush(stderr);
}

}  // namespace strobe::data
