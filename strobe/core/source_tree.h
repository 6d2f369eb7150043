// Where the Strobe source tree is at run time, for programs that read files from it (the benchmark
// suites' configs, the tests' fixtures). Nothing about the checkout is compiled in: objects are the
// same bytes in every checkout, so the build cache fills in one and hits in another.
#pragma once

#include <string>

namespace strobe {

// $STROBE_SOURCE_DIR when set; else the nearest directory above the running executable that holds
// configs/ and strobe/ (build trees live inside the checkout: <root>/build/bin/strobe); else "".
std::string source_tree();

}  // namespace strobe
