#include "strobe/config/saved_config.h"

#include <yaml-cpp/yaml.h>

namespace strobe::config {

SavedConfig::SavedConfig(std::string text, std::string source)
    : text_(std::move(text)),
      doc_(Document::load_string(text_, source)),
      root_(doc_.root().node()),
      leaves_(flatten_config(root_)) {}

std::string SavedConfig::leaf(const std::string& path) const {
  for (const auto& [key, value] : leaves_)
    if (key == path) return value;
  return "";
}

// SavedConfig::plugins is beside parse_plugins, in experiment.cpp.

std::string SavedConfig::section_yaml(const std::string& key) const {
  const YAML::Node& root = root_;
  const YAML::Node section = root[key];
  if (!section.IsDefined()) return "";
  YAML::Emitter out;
  out << section;
  return out.c_str();
}

}  // namespace strobe::config
