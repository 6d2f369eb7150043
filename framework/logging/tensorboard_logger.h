// TensorBoardLogger: a MetricConsumer that writes each delivered metric row as TensorBoard scalars,
// and the resolved config as hyperparameters (text plugin), into the run directory.
#pragma once

#include <memory>
#include <string>

#include "framework/logging/log_collector.h"

namespace strobe::logging {
namespace tensorboard {
class EventFileWriter;
}

class TensorBoardLogger : public MetricConsumer {
 public:
  TensorBoardLogger(const std::string& log_dir, const std::string& resolved_config_yaml);
  ~TensorBoardLogger() override;
  void consume(const MetricRow& row) override;
  void flush() override;

 private:
  std::unique_ptr<tensorboard::EventFileWriter> writer_;
};

}  // namespace strobe::logging
