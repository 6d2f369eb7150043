#include "strobe/logging/tensorboard_logger.h"

#include "strobe/config/resume_check.h"
#include "strobe/logging/tensorboard/event_writer.h"

namespace strobe::logging {

TensorBoardLogger::TensorBoardLogger(const std::string& log_dir, const std::string& yaml, int64_t resumed_from_step)
    : writer_(std::make_unique<tensorboard::EventFileWriter>(log_dir)) {
  if (resumed_from_step >= 0) writer_->add_session_start(resumed_from_step + 1);
  // The resolved config's leaves, spelled as everywhere else (config::flatten_config).
  writer_->add_hparams(config::flatten_config(yaml));
  writer_->flush();
  writer_->set_flush_interval(kFlushSeconds);
}

TensorBoardLogger::~TensorBoardLogger() {
  if (writer_) writer_->close();
}

void TensorBoardLogger::consume(const MetricRow& row) {
  for (const auto& kv : row.values) writer_->add_scalar(kv.first, kv.second, row.step);
}

void TensorBoardLogger::flush() { writer_->flush(); }

}  // namespace strobe::logging
