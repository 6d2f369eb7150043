#include "strobe/core/fault_points.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace strobe {
namespace {

struct FaultSpec {
  std::string point;
  int64_t step = -1;
  bool throws = false;
};

FaultSpec parse_spec() {
  FaultSpec s;
  const char* v = std::getenv("STROBE_FAULT_AT");
  if (!v) return s;
  std::string text(v);
  if (text.rfind("throw:", 0) == 0) {
    s.throws = true;
    text = text.substr(6);
  }
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
  if (spec.throws) throw std::runtime_error("fault point " + spec.point + " at step " + std::to_string(step) + " (STROBE_FAULT_AT)");
  ::kill(::getpid(), SIGKILL);
  ::pause();
}

}  // namespace strobe
