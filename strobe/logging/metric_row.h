// A row of logged values on the host, and what consumes rows (metrics.csv, TensorBoard, the progress
// bar, monitors): the log collector delivers each row once its device copy has landed.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace strobe::logging {

struct MetricRow {
  int64_t step = 0;
  int64_t epoch = 0;
  std::vector<std::pair<std::string, double>> values;
};

class MetricConsumer {
 public:
  virtual ~MetricConsumer() = default;
  virtual void consume(const MetricRow& row) = 0;
  virtual void flush() {}
};

}  // namespace strobe::logging
