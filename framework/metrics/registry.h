#pragma once
// Metrics by name, for configs: make_metric("f1", options). Names: accuracy, precision, recall,
// f1, fbeta, mean, sum, min, max, cat, mean_iou, mean_giou, perplexity, token_accuracy.
// The task (binary / multiclass / multilabel) of the classification metrics is options.task.
#include "framework/metrics/metric.h"

#include <memory>
#include <string>
#include <vector>

namespace strobe::metrics {

std::unique_ptr<Metric> make_metric(const std::string& name, const MetricOptions& options);
const std::vector<std::string>& metric_names();

// String forms used by configs; errors list the accepted values.
Average parse_average(const std::string& s);           // micro | macro | weighted | none
Task parse_task(const std::string& s);                 // binary | multiclass | multilabel
NanStrategy parse_nan_strategy(const std::string& s);  // propagate | ignore | replace

}  // namespace strobe::metrics
