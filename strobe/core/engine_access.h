// The engine's setters of public classes (not installed): what the trainer's loops set on a task
// (strobe/core/module.h) and on a data loader (strobe/data/loader.h). A component never calls them;
// they are private there, with this struct their one friend.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "strobe/core/module.h"
#include "strobe/data/loader.h"

namespace strobe {

struct EngineAccess {
  static void attach(Module& m, LogSink* sink, Stage stage, bool training) { m.attach(sink, stage, training); }
  static void set_current_batch_size(Module& m, int64_t n) { m.set_current_batch_size(n); }
  static void set_metric_sync(Module& m, std::function<void(metrics::MetricCollection&)> sync) {
    m.set_metric_sync(std::move(sync));
  }
  static void exclude_from(data::DataLoader& l, int64_t epoch, std::vector<int64_t> before) {
    l.exclude_from(epoch, std::move(before));
  }
  static void set_limit_batches(data::DataLoader& l, int64_t limit) { l.set_limit_batches(limit); }
  static void set_pin_memory(data::DataLoader& l, bool pin) { l.set_pin_memory(pin); }
  static void set_shuffle(data::DataLoader& l, bool shuffle) { l.set_shuffle(shuffle); }
};

}  // namespace strobe
