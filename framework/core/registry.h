// Registry: components (models, data modules, tasks, callbacks, optimizers, schedulers) are created
// by name from the config. Adding a component is one file plus one STROBE_REGISTER line in it.
//
// Contract: names are unique per registry (a duplicate aborts at start-up, a programming error);
// create() with an unknown name throws config::ConfigError naming the config key, the closest
// known name and the full list.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "framework/config/config.h"

namespace strobe {

template <class Product, class... Args>
class Registry {
 public:
  using Factory = std::function<Product(config::Section&, Args...)>;

  explicit Registry(std::string kind) : kind_(std::move(kind)) {}

  bool add(const std::string& name, Factory factory) {
    if (!factories_.emplace(name, std::move(factory)).second) {
      fmt::print(stderr, "internal error: {} '{}' registered twice\n", kind_, name);
      std::abort();
    }
    return true;
  }

  bool contains(const std::string& name) const { return factories_.count(name) > 0; }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& kv : factories_) out.push_back(kv.first);
    return out;
  }

  // Reads `name` from `section` (required unless `default_name` is given) and builds the component;
  // the factory reads the remaining keys and calls section.finish().
  Product create(config::Section& section, const std::string& default_name, Args... args) const {
    std::string name = default_name.empty() ? section.require_string("name") : section.get_string("name", default_name);
    auto it = factories_.find(name);
    if (it == factories_.end()) {
      std::vector<std::string> known = names();
      std::string hint = config::closest_match(name, known);
      std::string list;
      for (size_t i = 0; i < known.size(); ++i) list += (i ? ", " : "") + known[i];
      section.fail("name", fmt::format("unknown {} '{}'{} (known: {})", kind_, name,
                                       hint.empty() ? "" : fmt::format("; did you mean '{}'?", hint), list));
    }
    return it->second(section, args...);
  }

 private:
  std::string kind_;
  std::map<std::string, Factory> factories_;
};

#define STROBE_CONCAT_INNER(a, b) a##b
#define STROBE_CONCAT(a, b) STROBE_CONCAT_INNER(a, b)
// STROBE_REGISTER(model_registry(), "resnet", make_resnet);
#define STROBE_REGISTER(registry, name, factory) \
  static const bool STROBE_CONCAT(strobe_registered_, __COUNTER__) = (registry).add(name, factory)

}  // namespace strobe
