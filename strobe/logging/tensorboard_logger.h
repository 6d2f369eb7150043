// TensorBoardLogger: a MetricConsumer that writes each delivered metric row as TensorBoard scalars,
// and the resolved config as hyperparameters (text plugin), into the run directory. Rows reach the
// operating system at every flush() (the trainer flushes before each checkpoint) and at most
// kFlushSeconds after they were written, so a SIGKILL loses only the last few seconds. A run resumed
// from a checkpoint at step T writes TensorBoard's restart marker (SessionLog START at T + 1): the
// steps after T that the interrupted run had logged are hidden, and the continuation replaces them.
#pragma once

#include <memory>
#include <string>

#include "strobe/logging/log_collector.h"

namespace strobe::logging {
namespace tensorboard {
class EventFileWriter;
}

class TensorBoardLogger : public MetricConsumer {
 public:
  static constexpr double kFlushSeconds = 2.0;
  // `resumed_from_step` >= 0: the run continues from a checkpoint taken at that step.
  TensorBoardLogger(const std::string& log_dir, const std::string& resolved_config_yaml, int64_t resumed_from_step = -1);
  ~TensorBoardLogger() override;
  void consume(const MetricRow& row) override;
  void flush() override;

 private:
  std::unique_ptr<tensorboard::EventFileWriter> writer_;
};

}  // namespace strobe::logging
