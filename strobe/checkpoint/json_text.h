// JSON texts a user hands Strobe (a quarantine file, a Hugging Face config.json, COCO annotations)
// are parsed only once their nesting is bounded: nlohmann's parser follows any depth, and a file of
// 100,000 '[' exhausts memory instead of being refused in one line.
#pragma once

#include <string_view>

namespace strobe::checkpoint {

// The depth every reader of a user's JSON accepts (docs/CONFIG.md, "Limits").
inline constexpr int kMaxJsonDepth = 64;

// Whether the arrays and objects of `text` nest at most `max_depth` deep (strings skipped).
bool json_nesting_within(std::string_view text, int max_depth = kMaxJsonDepth);

}  // namespace strobe::checkpoint
