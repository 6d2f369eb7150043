// Registries: components (models, data modules, tasks, callbacks, metrics) are created by name.
// Adding a component is one file plus one STROBE_REGISTER line in it. The template lives in the
// config floor (torch-free, it needs only config::Section) so that every floor above can keep a
// registry of its own: metrics (strobe/metrics/registry.h) sit below the core's registries.
//
// Contract: names are unique per registry (a duplicate aborts at start-up, a programming error);
// an unknown name gets one message naming the kind, the closest known name and the full list.
// While a plugin loads (runner/plugins.h), a registration that fails — a name already registered, an
// exception thrown by the registration — is recorded in the plugin's RegistrationLog instead, and
// the loader reports it (exit 2) naming the plugin and the name; nothing aborts or terminates.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "strobe/config/config.h"

namespace strobe {

// The failures of the registrations that run while a plugin loads (null: none loading).
struct RegistrationLog {
  std::vector<std::string> errors;
};
RegistrationLog*& current_registration_log();  // strobe/config/config.cpp

// Runs a STROBE_REGISTER line's registration: while a plugin loads, an exception escaping it is
// recorded (it would otherwise leave dlopen through a static initialiser and terminate the process).
template <class F>
bool guarded_registration(const char* name, F&& add) {
  RegistrationLog* log = current_registration_log();
  if (log == nullptr) return add();
  try {
    return add();
  } catch (const std::exception& e) {
    log->errors.push_back(fmt::format("registering '{}' threw: {}", name, e.what()));
  } catch (...) {
    log->errors.push_back(fmt::format("registering '{}' threw a non-standard exception", name));
  }
  return false;
}

// Name -> factory of one kind of component, whatever the factory's signature.
template <class Factory>
class FactoryTable {
 public:
  explicit FactoryTable(std::string kind) : kind_(std::move(kind)) {}

  bool add(const std::string& name, Factory factory) {
    if (factories_.count(name)) {
      if (RegistrationLog* log = current_registration_log()) {
        log->errors.push_back(fmt::format("{} '{}' is already registered (built in or by another plugin)", kind_, name));
        return false;
      }
      fmt::print(stderr, "internal error: {} '{}' registered twice\n", kind_, name);
      std::abort();
    }
    factories_.emplace(name, std::move(factory));
    return true;
  }

  const std::string& kind() const { return kind_; }
  bool contains(const std::string& name) const { return factories_.count(name) > 0; }

  // Sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& kv : factories_) out.push_back(kv.first);
    return out;
  }

  // The factory of `name`, or null.
  const Factory* find(const std::string& name) const {
    auto it = factories_.find(name);
    return it == factories_.end() ? nullptr : &it->second;
  }

  // "unknown <kind> '<name>'; did you mean '<closest>'? (known: a, b, c)"; with no close name, the
  // hint that a plugin's component needs its library loaded.
  std::string unknown_message(const std::string& name) const {
    std::vector<std::string> known = names();
    std::string hint = config::closest_match(name, known);
    std::string list;
    for (size_t i = 0; i < known.size(); ++i) list += (i ? ", " : "") + known[i];
    return fmt::format("unknown {} '{}'{} (known: {}){}", kind_, config::shown(name),
                       hint.empty() ? "" : fmt::format("; did you mean '{}'?", hint), list,
                       hint.empty() ? "; a plugin's? load its library with --plugin FILE or a plugins: entry" : "");
  }

 private:
  std::string kind_;
  std::map<std::string, Factory> factories_;
};

// Components configured by a config section: the factory reads its own keys from it.
template <class Product, class... Args>
class Registry : public FactoryTable<std::function<Product(config::Section&, Args...)>> {
 public:
  using Factory = std::function<Product(config::Section&, Args...)>;
  using FactoryTable<Factory>::FactoryTable;

  // Reads `name` from `section` (required unless `default_name` is given) and builds the component;
  // the factory reads the remaining keys and calls section.finish().
  Product create(config::Section& section, const std::string& default_name, Args... args) const {
    std::string name = default_name.empty() ? section.require_string("name") : section.get_string("name", default_name);
    const Factory* factory = this->find(name);
    if (factory == nullptr) section.fail("name", this->unknown_message(name));
    return (*factory)(section, args...);
  }
};

#define STROBE_CONCAT_INNER(a, b) a##b
#define STROBE_CONCAT(a, b) STROBE_CONCAT_INNER(a, b)
// STROBE_REGISTER(model_registry(), "resnet", make_resnet);
#define STROBE_REGISTER(registry, name, factory)                                     \
  static const bool STROBE_CONCAT(strobe_registered_, __COUNTER__) =                 \
      ::strobe::guarded_registration(name, [] { return (registry).add(name, factory); })

}  // namespace strobe
