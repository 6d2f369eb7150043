#include "strobe/core/callback.h"

#include <nlohmann/json.hpp>

namespace strobe {

nlohmann::json Callback::state_dict() const { return nlohmann::json::object(); }
void Callback::load_state_dict(const nlohmann::json&) {}

CallbackRegistry& callback_registry() {
  static CallbackRegistry r("callback");
  return r;
}

}  // namespace strobe
