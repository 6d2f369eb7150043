#include "strobe/core/quarantine.h"

#include <limits>

#include <fmt/format.h>

#include "strobe/checkpoint/json_text.h"

namespace strobe {
namespace {

// What is wrong with `j` as a quarantine file ("" when nothing); `indices` filled when not null.
std::string problem(const nlohmann::json& j, std::map<std::string, std::vector<int64_t>>* indices) {
  const auto marker = j.is_object() ? j.find("strobe_quarantine") : j.end();
  if (!j.is_object() || marker == j.end() || !marker->is_number_integer() || marker->get<int64_t>() != 1 ||
      !j.contains("samples") || !j["samples"].is_array())
    return "is not a Strobe quarantine file (no \"strobe_quarantine\": 1 with a \"samples\" list; strobe replay --bisect "
           "--write-quarantine writes one)";
  for (const auto& s : j["samples"]) {
    const std::string shown = s.dump().substr(0, 120);
    const nlohmann::json* split = s.is_object() && s.contains("split") ? &s["split"] : nullptr;
    if (split == nullptr || !split->is_string() ||
        (*split != "train" && *split != "val" && *split != "test"))
      return fmt::format("a sample without a split of train, val or test: {}", shown);
    const nlohmann::json* index = s.contains("index") ? &s["index"] : nullptr;
    if (index == nullptr || !index->is_number_integer())
      return fmt::format("a sample without an integer index: {}", shown);
    if (index->is_number_unsigned() ? index->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                                    : index->get<int64_t>() < 0)
      return fmt::format("a sample whose index is not a dataset index (0 to 2^63-1): {}", shown);
    if (indices != nullptr) (*indices)[split->get<std::string>()].push_back(index->get<int64_t>());
  }
  return "";
}

}  // namespace

bool is_quarantine(const nlohmann::json& j) { return problem(j, nullptr).empty(); }

Quarantine read_quarantine(const std::string& path) {
  checkpoint::JsonFile f = checkpoint::read_json_file(path, size_t{64} << 20);
  using P = checkpoint::JsonFile::Problem;
  switch (f.problem) {
    case P::kNone:
      break;
    case P::kNotRegular:
      throw QuarantineError(fmt::format("'{}' is {}, not a regular file", path, f.detail));
    case P::kUnreadable:
      throw QuarantineError(fmt::format("cannot read '{}' ({})", path, f.detail));
    case P::kTooLarge:
      throw QuarantineError(fmt::format("'{}' is {} bytes: a quarantine file is at most 64 MiB", path, f.detail));
    case P::kTooDeep:
      throw QuarantineError(
          fmt::format("'{}' is not a Strobe quarantine file (it nests deeper than {} levels)", path, checkpoint::kMaxJsonDepth));
    case P::kNotJson:
      throw QuarantineError(fmt::format("'{}' is not a Strobe quarantine file (it is not JSON)", path));
  }
  Quarantine q;
  q.json = std::move(f.json);
  if (std::string why = problem(q.json, &q.indices); !why.empty())
    throw QuarantineError(why.rfind("is not", 0) == 0 ? fmt::format("'{}' {}", path, why) : fmt::format("'{}': {}", path, why));
  return q;
}

}  // namespace strobe
