#include "strobe/core/source_tree.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

namespace strobe {
namespace {

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

std::string source_tree() {
  if (const char* env = std::getenv("STROBE_SOURCE_DIR"); env && *env) return env;
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string dir(buf, static_cast<size_t>(n));
  // POSIX calls only: the torch wheel's libtorch exports its own std::filesystem symbols.
  for (int up = 0; up < 6; ++up) {
    const auto slash = dir.find_last_of('/');
    if (slash == std::string::npos || slash == 0) return "";
    dir.resize(slash);
    if (is_dir(dir + "/configs") && is_dir(dir + "/framework")) return dir;
  }
  return "";
}

}  // namespace strobe
