#include "strobe/core/fault_points.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace strobe {
namespace {

struct FaultSpec {
  std::string point;
  int64_t step = -1;
};

FaultSpec parse_spec() {
  FaultSpec s;
  const char* v = std::getenv("STROBE_FAULT_AT");
  if (!v) return s;
  const std::string text(v);
  const auto at = text.rfind('@');
  if (at == std::string::npos || at == 0) return s;
  try {
    s.step = std::stoll(text.substr(at + 1));
    s.point = text.substr(0, at);
  } catch (const std::exception&) {
    s.step = -1;
  }
  return s;
}

}  // namespace

void fault_point(const char* point, int64_t step) {
  static const FaultSpec spec = parse_spec();
  if (spec.step < 0 || step != spec.step || spec.point != point) return;
  ::kill(::getpid(), SIGKILL);
  ::pause();
}

}  // namespace strobe
