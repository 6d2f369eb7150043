// A plugin whose static initialiser throws outside any STROBE_REGISTER line (a global that reads a
// file it cannot find): the exception cannot reach a catch around dlopen; strobe still says which
// plugin and why, with exit 2, instead of an abort.
#include <stdexcept>

namespace plugin_initialiser_throws {
struct Settings {
  Settings() { throw std::runtime_error("cannot read plugin_settings.json"); }
};
const Settings settings;
}  // namespace plugin_initialiser_throws
