// CsvLogger: the run's metrics.csv (docs/CONFIG.md "Run directory").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strobe/logging/metric_row.h"

namespace strobe::logging {

// metrics.csv: header `step,epoch,<metric>...` (metrics sorted) and one row per step: the values a
// step delivers at different times (training values, host values such as the learning rate, the
// validation means) are merged into that step's row, which is rewritten in place. Each row is in the
// file (written to the operating system) as soon as it is consumed, so a SIGKILL loses nothing
// already consumed. A new metric name rewrites the whole file (atomically) with the wider header, as
// Lightning's CSVLogger does.
class CsvLogger : public MetricConsumer {
 public:
  // With `keep_until_step` >= 0 an existing file's rows up to that step are kept (resume).
  CsvLogger(std::string path, int64_t keep_until_step = -1);
  ~CsvLogger() override;
  void consume(const MetricRow& row) override;
  void flush() override;

 private:
  // Merges `row` into rows_; returns the index of the first row whose text changed.
  size_t merge(const MetricRow& row, bool* appended);
  void rewrite();
  void rewrite_tail(size_t from);
  std::string format_row(const MetricRow& row) const;
  std::string path_;
  std::vector<std::string> columns_;
  std::vector<MetricRow> rows_;       // sorted by step
  std::vector<uint64_t> offsets_;     // byte offset of each row in the file
  uint64_t end_ = 0;                  // file size
  int fd_ = -1;
};

}  // namespace strobe::logging
