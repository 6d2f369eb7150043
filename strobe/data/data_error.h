// Bad data: DataError names the file and what is wrong; the CLI maps it to exit status 2 (one line,
// no stack trace). With `on_bad_sample: skip` a dataset instead drops the sample and records it in a
// BadSampleLog, which prints each bad file once on stderr with the running count, so nothing is
// dropped silently. A dropped sample is an empty Sample; the loader leaves it out of its batch.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

namespace strobe::data {

struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws DataError "PATH: is a FIFO, not a regular file" when `path` exists and is not a regular file
// (a FIFO would block the read forever, a device would be read until memory runs out). Every reader of
// a data file calls it before opening (checkpoint::non_regular_kind: stat never blocks).
void require_regular_file(const std::string& path);

enum class OnBadSample { Error, Skip };

class BadSampleLog {
 public:
  BadSampleLog(std::string dataset, OnBadSample mode) : dataset_(std::move(dataset)), mode_(mode) {}
  OnBadSample mode() const { return mode_; }
  // Under Error throws DataError(what); under Skip records it (printing `what` the first time `key`
  // is seen) and returns. `what` already names the file.
  void bad(const std::string& key, const std::string& what) const;
  // Distinct bad items seen so far (a file skipped in several epochs counts once).
  int64_t count() const { return count_.load(); }

 private:
  std::string dataset_;
  OnBadSample mode_;
  mutable std::mutex mu_;
  mutable std::set<std::string> seen_;
  mutable std::atomic<int64_t> count_{0};
};

}  // namespace strobe::data
