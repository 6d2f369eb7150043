// Plugins: shared libraries of components (models, tasks, data modules, callbacks, metrics) built
// against an installed Strobe with strobe_add_plugin (cmake/StrobePlugin.cmake), whose STROBE_REGISTER
// lines join libstrobe's registries when the library is loaded. `--plugin PATH` and the experiment's
// top-level `plugins: [PATH, ...]` load them before any component is built.
//
// Contract: a plugin is checked before any of its code runs. The file must be an ELF shared library
// holding Strobe's marker (the `.strobe_plugin` section strobe_add_plugin adds: the Strobe and
// libtorch versions it was built against), and those versions must be this Strobe's; then it is
// loaded (RTLD_NOW | RTLD_GLOBAL) with its registrations recorded: a name that is already
// registered, or a registration that throws, fails the load. Every failure is a PluginError (exit 2)
// whose one line names the plugin and the problem. A library that was loaded stays loaded (its
// registrations cannot be taken back), including one whose registrations partly failed.
// Loading the same file twice does nothing the second time.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace strobe {

class PluginError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The marker strobe_add_plugin writes: "strobe-plugin 1 strobe=<version> torch=<version>".
struct PluginMarker {
  std::string strobe_version, torch_version;
};

// Reads the marker of the file at `path` without loading it; throws PluginError (not a file, not an
// ELF shared library, no marker, a marker it cannot read).
PluginMarker read_plugin_marker(const std::string& path);

// Loads each plugin in order (see the contract); returns the absolute paths loaded.
std::vector<std::string> load_plugins(const std::vector<std::string>& paths);

}  // namespace strobe
