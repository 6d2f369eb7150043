#include "strobe/checkpoint/json_text.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "strobe/checkpoint/mapped_file.h"

namespace strobe::checkpoint {

bool json_nesting_within(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

JsonFile read_json_file(const std::string& path, size_t max_bytes) {
  JsonFile f;
  using P = JsonFile::Problem;
  if (std::string kind = non_regular_kind(path); !kind.empty()) {
    f.problem = P::kNotRegular, f.detail = std::move(kind);
    return f;
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    f.problem = P::kUnreadable, f.detail = std::strerror(errno);
    return f;
  }
  if (static_cast<size_t>(st.st_size) > max_bytes) {
    f.problem = P::kTooLarge, f.detail = std::to_string(st.st_size);
    return f;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    f.problem = P::kUnreadable, f.detail = std::strerror(errno);
    return f;
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) {
    f.problem = P::kUnreadable, f.detail = "a read failed";
    return f;
  }
  if (!json_nesting_within(text)) {
    f.problem = P::kTooDeep;
    return f;
  }
  f.json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (f.json.is_discarded()) f.problem = P::kNotJson, f.json = nullptr;
  return f;
}

}  // namespace strobe::checkpoint
