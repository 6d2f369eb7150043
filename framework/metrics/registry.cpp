#include "framework/metrics/registry.h"

#include "framework/metrics/aggregation.h"
#include "framework/metrics/classification.h"
#include "framework/metrics/detection.h"
#include "framework/metrics/language.h"

#include <functional>
#include <map>

namespace strobe::metrics {
namespace {

using Factory = std::function<std::unique_ptr<Metric>(const MetricOptions&)>;

template <typename T>
Factory factory() {
  return [](const MetricOptions& o) { return std::make_unique<T>(o); };
}

const std::map<std::string, Factory>& factories() {
  static const std::map<std::string, Factory> table = {
      {"accuracy", factory<Accuracy>()},     {"precision", factory<Precision>()},
      {"recall", factory<Recall>()},         {"f1", factory<F1Score>()},
      {"fbeta", factory<FBetaScore>()},      {"mean", factory<MeanMetric>()},
      {"sum", factory<SumMetric>()},         {"min", factory<MinMetric>()},
      {"max", factory<MaxMetric>()},         {"cat", factory<CatMetric>()},
      {"mean_iou", factory<MeanIoU>()},      {"mean_giou", factory<MeanGIoU>()},
      {"perplexity", factory<Perplexity>()}, {"token_accuracy", factory<TokenAccuracy>()},
  };
  return table;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

template <typename E>
E parse_enum(const std::string& what, const std::string& s, const std::map<std::string, E>& values) {
  auto it = values.find(s);
  if (it != values.end()) return it->second;
  std::vector<std::string> names;
  for (const auto& [k, v] : values) names.push_back(k);
  TORCH_CHECK_VALUE(false, "unknown ", what, " '", s, "'; expected one of: ", join(names));
  return E{};
}

}  // namespace

std::unique_ptr<Metric> make_metric(const std::string& name, const MetricOptions& options) {
  auto it = factories().find(name);
  TORCH_CHECK_VALUE(it != factories().end(), "unknown metric '", name,
              "'; expected one of: ", join(metric_names()));
  return it->second(options);
}

const std::vector<std::string>& metric_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& [k, v] : factories()) out.push_back(k);
    return out;
  }();
  return names;
}

Average parse_average(const std::string& s) {
  return parse_enum<Average>("average", s,
                             {{"micro", Average::kMicro},
                              {"macro", Average::kMacro},
                              {"weighted", Average::kWeighted},
                              {"none", Average::kNone}});
}

Task parse_task(const std::string& s) {
  return parse_enum<Task>("task", s,
                          {{"binary", Task::kBinary}, {"multiclass", Task::kMulticlass}, {"multilabel", Task::kMultilabel}});
}

NanStrategy parse_nan_strategy(const std::string& s) {
  return parse_enum<NanStrategy>(
      "nan_strategy", s,
      {{"propagate", NanStrategy::kPropagate}, {"ignore", NanStrategy::kIgnore}, {"replace", NanStrategy::kReplace}});
}

}  // namespace strobe::metrics
