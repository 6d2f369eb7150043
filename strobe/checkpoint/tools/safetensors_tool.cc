// strobe_safetensors_tool: Strobe's safetensors reader and writer from the command line, for
// tests/python/test_safetensors.py (which checks them against the safetensors package).
//   dump FILE                     JSON: metadata, and per tensor name, dtype, shape, CRC-32 of its bytes
//   copy IN OUT [--meta K=V]...   reads IN and writes its tensors (in order) and metadata (plus K=V) to OUT
// A file Strobe refuses: one line on stderr, exit 2.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/safetensors.h"

namespace st = strobe::safetensors;

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 2 && args[0] == "dump") {
      st::File f = st::read_file(args[1]);
      nlohmann::json out = {{"metadata", f.metadata}, {"tensors", nlohmann::json::array()}};
      for (const auto& [name, t] : f.tensors) {
        out["tensors"].push_back({{"name", name},
                                  {"dtype", c10::toString(t.scalar_type())},
                                  {"shape", t.sizes().vec()},
                                  {"crc32", strobe::checkpoint::crc32(t.data_ptr(), t.nbytes())}});
      }
      fmt::print("{}\n", out.dump());
      return 0;
    }
    if (args.size() >= 3 && args[0] == "copy") {
      st::File f = st::read_file(args[1]);
      for (size_t i = 3; i < args.size(); i += 2) {
        const auto eq = i + 1 < args.size() ? args[i + 1].find('=') : std::string::npos;
        if (args[i] != "--meta" || eq == std::string::npos)
          throw std::runtime_error("expected --meta KEY=VALUE, got '" + args[i] + "'");
        f.metadata[args[i + 1].substr(0, eq)] = args[i + 1].substr(eq + 1);
      }
      st::write_file(args[2], f.tensors, f.metadata);
      return 0;
    }
    fmt::print(stderr, "usage: strobe_safetensors_tool dump FILE | copy IN OUT [--meta K=V]...\n");
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "strobe_safetensors_tool: {}\n", e.what());
    return 2;
  }
}
