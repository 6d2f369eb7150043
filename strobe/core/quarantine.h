// The quarantine file (docs/NAN_CAPTURE.md, "Bisect"): {"strobe_quarantine": 1, "samples": [{"split":
// "train"|"val"|"test", "index": N, "source"?, "capture"?}]}. One reader for `data.exclude` and for
// `strobe replay --bisect --write-quarantine`, which adds to an existing file.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace strobe {

// A file that is not a readable quarantine file: one line naming it and what is wrong.
struct QuarantineError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Quarantine {
  nlohmann::json json;                                     // the file's content, as read
  std::map<std::string, std::vector<int64_t>> indices;     // split -> dataset indices, in file order
};

// Reads `path`. Refused (QuarantineError): a path that is not a regular file (a FIFO is never
// opened, a directory never read), cannot be read or is over 64 MiB, text that nests deeper than
// checkpoint::kMaxJsonDepth or is not JSON, JSON without the marker `"strobe_quarantine": 1` (the
// integer; `true` is not it) and a `samples` array, and a sample that is not an object with a split
// of train, val or test and an index that is a non-negative 64-bit integer.
Quarantine read_quarantine(const std::string& path);

// Whether `j` is a quarantine file's content (the same checks on parsed JSON).
bool is_quarantine(const nlohmann::json& j);

}  // namespace strobe
