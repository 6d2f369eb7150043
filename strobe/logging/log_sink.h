// LogSink: where a module's log(name, value) goes (the trainer's LogCollector), and how a value is
// aggregated. Its own header so that logging does not depend on the core's Module.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <torch/types.h>

namespace strobe {

struct LogOptions {
  std::optional<bool> on_step;   // default: true in training, false otherwise
  std::optional<bool> on_epoch;  // default: false in training, true otherwise
  bool prog_bar = false;
};

class LogSink {
 public:
  virtual ~LogSink() = default;
  virtual void log(const std::string& name, const torch::Tensor& value, const LogOptions& options,
                   int64_t batch_size) = 0;
};

}  // namespace strobe
