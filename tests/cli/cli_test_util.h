// Helpers for tests that run the strobe executable ($STROBE_BIN, else bin/strobe from the build dir).
#pragma once

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "tests/trainer/trainer_test_util.h"

namespace strobe::testing {

struct CmdResult {
  int code;
  std::string out, err;
};

inline std::string bin() {
  const char* b = std::getenv("STROBE_BIN");
  return b ? b : "bin/strobe";
}

inline std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// `prefix` goes before the executable in the shell command line (environment, ulimit).
inline CmdResult shell_cmd(const std::string& prefix, const std::string& args) {
  std::string dir = temp_dir("cli");
  std::string cmd = "(" + prefix + bin() + " " + args + ") > " + dir + "/out 2> " + dir + "/err";
  int rc = std::system(cmd.c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(dir + "/out"), slurp(dir + "/err")};
}

inline CmdResult strobe_cmd(const std::string& args) { return shell_cmd("", args); }

inline std::string write_config(const std::string& yaml) {
  std::string p = temp_dir("cfg") + "/exp.yaml";
  std::ofstream(p) << yaml;
  return p;
}

inline int count_lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

// The value `strobe validate` / `test` prints for `key` ("test/acc     0.912000"); NaN when absent.
inline double printed_metric(const std::string& out, const std::string& key) {
  const auto at = out.find(key + " ");
  if (at == std::string::npos) return std::nan("");
  return std::stod(out.substr(out.find_first_not_of(' ', at + key.size())));
}

// Pieces of `s` between any of the characters in `seps` (empty pieces dropped).
inline std::vector<std::string> split_any(const std::string& s, const std::string& seps) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find_first_of(seps, start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace strobe::testing
