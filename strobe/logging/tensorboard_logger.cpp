#include "strobe/logging/tensorboard_logger.h"

#include <yaml-cpp/yaml.h>

#include "strobe/logging/tensorboard/event_writer.h"

namespace strobe::logging {
namespace {
void flatten(const YAML::Node& n, const std::string& prefix, std::vector<std::pair<std::string, std::string>>& out) {
  if (n.IsMap()) {
    for (auto it = n.begin(); it != n.end(); ++it)
      flatten(it->second, prefix.empty() ? it->first.Scalar() : prefix + "." + it->first.Scalar(), out);
  } else if (n.IsSequence()) {
    for (size_t i = 0; i < n.size(); ++i) flatten(n[i], prefix + "." + std::to_string(i), out);
  } else {
    out.emplace_back(prefix, n.IsNull() ? "null" : n.Scalar());
  }
}
}  // namespace

TensorBoardLogger::TensorBoardLogger(const std::string& log_dir, const std::string& yaml, int64_t resumed_from_step)
    : writer_(std::make_unique<tensorboard::EventFileWriter>(log_dir)) {
  if (resumed_from_step >= 0) writer_->add_session_start(resumed_from_step + 1);
  std::vector<std::pair<std::string, std::string>> hp;
  if (!yaml.empty()) flatten(YAML::Load(yaml), "", hp);
  writer_->add_hparams(hp);
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
