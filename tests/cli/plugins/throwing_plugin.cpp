// A plugin whose registration throws while the library loads: reported, never a terminate.
#include <stdexcept>

#include "strobe/core/model.h"

namespace plugin_throws {
strobe::ModelRegistry::Factory factory_needing_a_table() { throw std::runtime_error("the lookup table is missing"); }
STROBE_REGISTER(strobe::model_registry(), "plugin_throwing_model", factory_needing_a_table());
}  // namespace plugin_throws
