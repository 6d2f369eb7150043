// The YAML type of every scalar of a document, as a reader that knows nothing of Strobe sees it
// (YAML 1.2 core schema; a quoted scalar is a string): the resolved config must keep each one.
#pragma once

#include <cstdlib>
#include <map>
#include <regex>
#include <string>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

namespace strobe::testing {

// The type a YAML reader gives a scalar (core schema; a quoted scalar is a string).
inline std::string yaml_type(const YAML::Node& n) {
  if (n.IsNull()) return "null";
  if (n.IsMap()) return "map";
  if (n.IsSequence()) return "seq";
  if (n.Tag() == "!") return "str";
  const std::string& s = n.Scalar();
  static const std::regex int_re(R"(^[-+]?[0-9]+$)"), float_re(R"(^[-+]?(\.[0-9]+|[0-9]+\.[0-9]*)([eE][-+]?[0-9]+)?$|^[-+]?[0-9]+[eE][-+]?[0-9]+$)"),
      bool_re(R"(^(true|false|True|False|TRUE|FALSE)$)");
  if (std::regex_match(s, int_re)) return "int";
  if (std::regex_match(s, float_re)) return "float";
  if (std::regex_match(s, bool_re)) return "bool";
  return "str";
}

// Every scalar of a document as {path -> "type:value"} (floats compared by value, not spelling).
inline void flatten(const YAML::Node& n, const std::string& path, std::map<std::string, std::string>& out) {
  if (n.IsMap()) {
    for (auto it = n.begin(); it != n.end(); ++it) flatten(it->second, path + "." + it->first.Scalar(), out);
  } else if (n.IsSequence()) {
    for (size_t i = 0; i < n.size(); ++i) flatten(n[i], path + "[" + std::to_string(i) + "]", out);
  } else {
    std::string t = yaml_type(n);
    std::string v = n.IsNull() ? "" : n.Scalar();
    if (t == "float") v = fmt::format("{}", std::strtod(v.c_str(), nullptr));
    out[path] = t + ":" + v;
  }
}

inline std::map<std::string, std::string> flat(const std::string& yaml) {
  std::map<std::string, std::string> out;
  flatten(YAML::Load(yaml), "", out);
  return out;
}


}  // namespace strobe::testing
