// A plugin registering a name Strobe already has: refused when loaded, naming the plugin and the name.
#include "strobe/core/model.h"

namespace plugin_duplicate {
std::shared_ptr<strobe::Model> make_none(strobe::config::Section&) { return nullptr; }
STROBE_REGISTER(strobe::model_registry(), "mlp", make_none);
}  // namespace plugin_duplicate
