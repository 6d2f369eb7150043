#pragma once
// Metrics by name, for configs: make_metric("f1", options). Each metric registers beside its class
// (STROBE_REGISTER(metric_registry(), "f1", metric_factory<F1Score>())), like models, tasks, data
// modules and callbacks. Built in: accuracy, precision, recall, f1, fbeta, mean, sum, min, max,
// cat, mean_iou, mean_giou, perplexity, token_accuracy. The task (binary / multiclass / multilabel)
// of the classification metrics is options.task.
#include "strobe/config/registry.h"
#include "strobe/metrics/metric.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace strobe::metrics {

using MetricFactory = std::function<std::unique_ptr<Metric>(const MetricOptions&)>;
using MetricRegistry = FactoryTable<MetricFactory>;
MetricRegistry& metric_registry();

template <typename T>
MetricFactory metric_factory() {
  return [](const MetricOptions& o) { return std::make_unique<T>(o); };
}

// Throws c10::ValueError naming the closest registered metric and all of them.
std::unique_ptr<Metric> make_metric(const std::string& name, const MetricOptions& options);
std::vector<std::string> metric_names();  // sorted

// String forms used by configs; errors list the accepted values.
Average parse_average(const std::string& s);           // micro | macro | weighted | none
Task parse_task(const std::string& s);                 // binary | multiclass | multilabel
NanStrategy parse_nan_strategy(const std::string& s);  // propagate | ignore | replace

}  // namespace strobe::metrics
