#include "runner/command_inputs.h"

#include <sys/stat.h>

#include <fmt/format.h>

namespace strobe {
namespace {

void collect(const YAML::Node& node, const std::string& key, std::vector<checkpoint::CommandInput>& out, int depth) {
  if (depth > 32) return;
  if (node.IsScalar()) {
    const std::string& value = node.Scalar();
    struct stat st {};
    if (!value.empty() && ::stat(value.c_str(), &st) == 0)
      out.push_back({fmt::format("the {} named by {}", S_ISDIR(st.st_mode) ? "directory" : "file", key), value});
    return;
  }
  if (node.IsSequence()) {
    for (size_t i = 0; i < node.size(); ++i) collect(node[i], fmt::format("{}[{}]", key, i), out, depth + 1);
    return;
  }
  if (!node.IsMap()) return;
  for (const auto& kv : node) {
    if (!kv.first.IsScalar()) continue;
    const std::string name = kv.first.Scalar();
    if (name == "name" || (depth == 0 && (name == "trainer" || name == "callbacks"))) continue;
    collect(kv.second, key.empty() ? name : key + "." + name, out, depth + 1);
  }
}

}  // namespace

std::vector<checkpoint::CommandInput> experiment_inputs(const YAML::Node& root, const std::string& config_path) {
  std::vector<checkpoint::CommandInput> out;
  if (!config_path.empty()) out.push_back({"the config file", config_path});
  collect(root, "", out, 0);
  return out;
}

}  // namespace strobe
