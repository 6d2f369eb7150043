// The registry instances (function-local statics: safe to use from other files' static initializers).
#include "strobe/core/datamodule.h"
#include "strobe/core/model.h"
#include "strobe/core/module.h"

namespace strobe {

int64_t list_index(const std::string& param, const std::string& list) {
  if (param.size() <= list.size() + 1 || param.compare(0, list.size(), list) != 0 || param[list.size()] != '.') return -1;
  size_t i = list.size() + 1, end = i;
  while (end < param.size() && param[end] >= '0' && param[end] <= '9') ++end;
  if (end == i || end >= param.size() || param[end] != '.') return -1;
  return std::stoll(param.substr(i, end - i));
}

ModelRegistry& model_registry() {
  static ModelRegistry r("model");
  return r;
}

TaskRegistry& task_registry() {
  static TaskRegistry r("task");
  return r;
}

DataRegistry& data_registry() {
  static DataRegistry r("data module");
  return r;
}

}  // namespace strobe
