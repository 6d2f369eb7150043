// The registry instances (function-local statics: safe to use from other files' static initializers).
#include "strobe/core/datamodule.h"
#include "strobe/core/model.h"
#include "strobe/core/module.h"

namespace strobe {

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
