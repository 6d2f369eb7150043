// libFuzzer target: the safetensors header parser on arbitrary bytes (scripts/fuzz.sh builds it with
// ASan + UBSan). It must refuse or accept without a crash, an over-read or a leak; what it accepts must
// keep every tensor inside the file and the buffer tiled exactly.
#include <cstdint>
#include <cstdlib>

#include "strobe/checkpoint/safetensors_format.h"

namespace st = strobe::safetensors;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    st::Header h = st::parse_header(reinterpret_cast<const char*>(data), size);
    uint64_t at = 0;
    for (const auto& t : h.tensors) {
      uint64_t bytes = st::dtype_size(t.dtype);
      for (int64_t d : t.shape) bytes *= static_cast<uint64_t>(d);
      if (t.begin != at || t.end - t.begin != bytes || h.data_start + t.end > size) std::abort();
      at = t.end;
    }
    if (h.data_start + at != size) std::abort();
  } catch (const st::FormatError&) {
  }
  return 0;
}
