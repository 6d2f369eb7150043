// Files of the source tree for tests (configs, fixtures), found at run time (strobe::source_tree):
// ctest sets STROBE_SOURCE_DIR; a test binary run by hand finds the checkout it was built in.
#pragma once

#include <stdexcept>
#include <string>

#include "strobe/core/source_tree.h"

namespace strobe::testing {

inline std::string source_path(const std::string& rel) {
  const std::string root = strobe::source_tree();
  if (root.empty()) throw std::runtime_error("the Strobe source tree was not found: set STROBE_SOURCE_DIR");
  return rel.empty() ? root : root + "/" + rel;
}

}  // namespace strobe::testing
