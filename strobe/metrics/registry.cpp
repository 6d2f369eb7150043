#include "strobe/metrics/registry.h"

#include <map>

namespace strobe::metrics {
namespace {

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

MetricRegistry& metric_registry() {
  static MetricRegistry r("metric");
  return r;
}

std::unique_ptr<Metric> make_metric(const std::string& name, const MetricOptions& options) {
  const MetricFactory* factory = metric_registry().find(name);
  TORCH_CHECK_VALUE(factory != nullptr, metric_registry().unknown_message(name));
  return (*factory)(options);
}

std::vector<std::string> metric_names() { return metric_registry().names(); }

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
