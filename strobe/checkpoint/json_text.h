// JSON texts a user hands Strobe (a quarantine file, a Hugging Face config.json, COCO annotations)
// are parsed only once their nesting is bounded: nlohmann's parser follows any depth, and a file of
// 100,000 '[' exhausts memory instead of being refused in one line.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace strobe::checkpoint {

// The depth every reader of a user's JSON accepts (docs/CONFIG.md, "Limits").
inline constexpr int kMaxJsonDepth = 64;

// Whether the arrays and objects of `text` nest at most `max_depth` deep (strings skipped).
bool json_nesting_within(std::string_view text, int max_depth = kMaxJsonDepth);

// A user's JSON file, read whole and parsed within bounds: a regular file (a FIFO is never opened)
// of at most `max_bytes`, nested at most kMaxJsonDepth deep. `problem` says why `json` is empty;
// each reader words it for its file (a quarantine file, a command's earlier output).
struct JsonFile {
  enum class Problem { kNone, kNotRegular, kUnreadable, kTooLarge, kTooDeep, kNotJson };
  Problem problem = Problem::kNone;
  std::string detail;  // kNotRegular: what it is ("a FIFO"); kUnreadable: why; kTooLarge: its bytes
  nlohmann::json json;
};
JsonFile read_json_file(const std::string& path, size_t max_bytes);

}  // namespace strobe::checkpoint
