// Plugins: shared libraries of components (models, tasks, data modules, callbacks, metrics) built
// against an installed Strobe with strobe_add_plugin (cmake/StrobePlugin.cmake), whose STROBE_REGISTER
// lines join libstrobe's registries when the library is loaded. `--plugin PATH` and the experiment's
// top-level `plugins: [PATH, ...]` load them before any component is built.
//
// Contract: a plugin is checked before any of its code runs. The file must be an ELF shared library
// holding Strobe's marker (the `.strobe_plugin` section strobe_add_plugin adds: the Strobe and
// libtorch versions it was built against, the fingerprint of the public headers it was compiled
// against and its C++ library ABI), and all of them must be this Strobe's; then it is
// loaded (RTLD_NOW | RTLD_GLOBAL) with its registrations recorded: a name that is already
// registered, or a registration that throws, fails the load. A static initialiser that throws
// outside a STROBE_REGISTER line cannot be caught (the exception meets the dynamic loader, and
// std::terminate runs): a terminate handler set around the load names the plugin and the exception's
// text on stderr and exits 2. Every failure is a PluginError (exit 2)
// whose one line names the plugin and the problem. A library that was loaded stays loaded (its
// registrations cannot be taken back), including one whose registrations partly failed.
// Loading the same file twice does nothing the second time.
//
// What a run loaded is recorded with the file's SHA-256 (the resolved config's `plugins:` entries
// {path, sha256}, in config.yaml, in every checkpoint and capture). A plugin whose file no longer has
// the recorded hash is refused naming both hashes, unless the caller allows changed plugins
// (--allow-changed-plugins): then it loads, the change is said once and kept (replaced_sha256).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "strobe/config/experiment.h"

namespace strobe {

class PluginError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The marker strobe_add_plugin writes: "strobe-plugin 1 strobe=<version> torch=<version>
// headers=<fingerprint> cxxabi=<libstdc++-cxx11|libstdc++-old|libc++>".
struct PluginMarker {
  std::string strobe_version, torch_version;
  std::string headers;  // the fingerprint of the public headers it was compiled against
  std::string cxx_abi;  // the C++ library ABI it was compiled for
};

// The fingerprint of the public headers this Strobe was built from (cmake/StrobePlugin.cmake).
const char* built_headers_fingerprint();

// Reads the marker of the file at `path` without loading it; throws PluginError (not a file, not an
// ELF shared library, no marker, a marker it cannot read).
PluginMarker read_plugin_marker(const std::string& path);

// A loaded plugin: its absolute path and the hash of what was loaded; `changed` says, in one line,
// that an allowed changed plugin was loaded in place of the recorded one (empty otherwise).
struct LoadedPlugin {
  config::PluginSpec spec;  // path, sha256 (what was loaded), replaced_sha256 (the recorded one it replaced)
  std::string changed;
};

// Loads each plugin in order (see the contract), checking each recorded hash; allow_changed: a changed
// plugin loads instead, with `changed` set.
std::vector<LoadedPlugin> load_plugins(const std::vector<config::PluginSpec>& plugins, bool allow_changed = false);
// The same for plain paths (nothing recorded to check).
std::vector<LoadedPlugin> load_plugins(const std::vector<std::string>& paths);

// --plugin PATH... joins the experiment's `plugins:` list (absolute, so the resolved config records
// where they were), as every command that builds a run from a config takes them.
void add_plugins_to(config::Document& doc, const std::vector<std::string>& paths);

// `plugins` with those the resolved config of a checkpoint or capture (`recorded`) names: a recorded
// plugin also named here (same path, else same file name) takes the recorded hash; one not named here is
// added from its recorded path. So a resume, validate, test or replay loads what the run was made with.
std::vector<config::PluginSpec> with_recorded_plugins(std::vector<config::PluginSpec> plugins,
                                                      const std::vector<config::PluginSpec>& recorded);

}  // namespace strobe
