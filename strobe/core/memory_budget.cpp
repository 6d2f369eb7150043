#include "strobe/core/memory_budget.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

namespace strobe {

uint64_t available_memory_bytes() {
  uint64_t avail = UINT64_MAX;
  {
    std::ifstream in("/proc/meminfo");
    for (std::string key; in >> key;) {
      uint64_t kb = 0;
      in >> kb;
      if (key == "MemAvailable:") {
        avail = kb * 1024;
        break;
      }
      in.ignore(256, '\n');
    }
  }
  // cgroup v2: the limit of this process's group minus what the group already uses.
  std::ifstream cg("/proc/self/cgroup");
  std::string line, rel;
  while (std::getline(cg, line))
    if (line.rfind("0::", 0) == 0) rel = line.substr(3);
  if (!rel.empty()) {
    namespace fs = std::filesystem;
    const fs::path dir = fs::path("/sys/fs/cgroup") / fs::path(rel).relative_path();
    std::ifstream max_in(dir / "memory.max"), cur_in(dir / "memory.current");
    std::string max_s;
    uint64_t cur = 0;
    if (max_in >> max_s && max_s != "max" && cur_in >> cur) {
      const uint64_t lim = std::stoull(max_s);
      avail = std::min(avail, lim > cur ? lim - cur : 0);
    }
  }
  return avail;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (b >= 1024.0 && u < 6) b /= 1024.0, ++u;
  return fmt::format("{:.1f} {}", b, units[u]);
}

void check_parameters_fit(const config::Section& cfg, double params, const std::vector<ParamTerm>& alone, const char* otherwise,
                          const std::string& shape) {
  const double need = params * 4.0, avail = static_cast<double>(available_memory_bytes());
  if (need <= avail) return;
  const char* key = otherwise;
  for (const auto& term : alone)
    if (term.params * 4.0 > avail) {
      key = term.key;
      break;
    }
  cfg.fail(key, fmt::format("the model's shape ({}) holds about {:.3g} parameters, {} as built in fp32, but only {} of memory "
                            "is available; use a smaller shape",
                            shape, params, human_bytes(need), human_bytes(avail)));
}

}  // namespace strobe
