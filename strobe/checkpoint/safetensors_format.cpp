#include "strobe/checkpoint/safetensors_format.h"

#include <algorithm>
#include <cstring>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

namespace strobe::safetensors {
namespace {

using json = nlohmann::json;

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kF64, "F64", 8}, {DType::kF32, "F32", 4}, {DType::kF16, "F16", 2}, {DType::kBF16, "BF16", 2},
    {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4}, {DType::kI16, "I16", 2}, {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},   {DType::kBool, "BOOL", 1},
};

const DTypeInfo& st_info(DType dtype) {
  for (const auto& d : kDTypes)
    if (d.dtype == dtype) return d;
  throw FormatError("internal error: unknown dtype");
}

// Shown in messages: a name as the file spells it, cut short.
std::string st_quote(const std::string& s) {
  constexpr size_t kMax = 80;
  return "'" + (s.size() > kMax ? s.substr(0, kMax) + "..." : s) + "'";
}

uint64_t st_unsigned(const json& v, const std::string& what) {
  if (!v.is_number_unsigned()) throw FormatError(fmt::format("{} is not a non-negative integer", what));
  return v.get<uint64_t>();
}

}  // namespace

const char* dtype_name(DType dtype) { return st_info(dtype).name; }
size_t dtype_size(DType dtype) { return st_info(dtype).size; }

bool parse_dtype(const std::string& name, DType* out) {
  for (const auto& d : kDTypes) {
    if (name == d.name) {
      *out = d.dtype;
      return true;
    }
  }
  return false;
}

namespace {

// A SAX reader of the header that checks its shape (no key twice in an object, containers nested
// at most three deep) and stops at the first problem; builds nothing.
struct HeaderShapeCheck {
  std::vector<std::set<std::string>> keys;  // per open object
  int open = 0;                             // open containers
  std::string refusal, invalid;

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const json::string_t&) { return true; }
  bool string(json::string_t&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool start_container() {
    if (open > 2) {
      refusal = "the JSON header nests deeper than a tensor entry";
      return false;
    }
    ++open;
    return true;
  }
  bool start_object(std::size_t) {
    keys.emplace_back();
    return start_container();
  }
  bool start_array(std::size_t) { return start_container(); }
  bool end_object() {
    keys.pop_back();
    --open;
    return true;
  }
  bool end_array() {
    --open;
    return true;
  }
  bool key(json::string_t& key) {
    if (keys.back().insert(key).second) return true;
    refusal = fmt::format(open == 1 ? "the name {} appears twice" : "the key {} appears twice in an entry", st_quote(key));
    return false;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    invalid = e.what();
    return false;
  }
};

}  // namespace

Header parse_header(const char* bytes, uint64_t size) {
  if (size < 8) throw FormatError(fmt::format("{} bytes, shorter than the 8-byte header length", size));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  if (n > kMaxHeaderBytes)
    throw FormatError(fmt::format("header length {} is above the limit of {} bytes", n, kMaxHeaderBytes));
  if (n > size - 8)
    throw FormatError(fmt::format("header length {} is beyond the file's {} bytes", n, size));
  Header header;
  header.data_start = 8 + n;
  const uint64_t buffer = size - header.data_start;

  // Duplicate keys are refused at any depth (nlohmann keeps the last silently); an entry nests two
  // levels at most (the top object, an entry, its shape list). Checked in one SAX pass, linear in the
  // header (json::parse's callback form rescans the parent object at each entry's end: quadratic,
  // minutes for 100,000 entries), then parsed.
  HeaderShapeCheck check;
  json::sax_parse(bytes + 8, bytes + 8 + n, &check);
  if (!check.refusal.empty()) throw FormatError(check.refusal);
  if (!check.invalid.empty()) throw FormatError(fmt::format("the header is not valid JSON ({})", check.invalid));
  json doc;
  try {
    doc = json::parse(bytes + 8, bytes + 8 + n);
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("the header is not valid JSON ({})", e.what()));
  }
  if (!doc.is_object()) throw FormatError("the header is not a JSON object");

  for (const auto& [name, entry] : doc.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw FormatError("__metadata__ is not an object of strings");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) throw FormatError(fmt::format("__metadata__ {} is not a string", st_quote(k)));
        header.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor " + st_quote(name);
    if (!entry.is_object()) throw FormatError(fmt::format("{} is not an object", where));
    for (const auto& [k, v] : entry.items()) {
      (void)v;
      if (k != "dtype" && k != "shape" && k != "data_offsets")
        throw FormatError(fmt::format("{} has an unknown key {}", where, st_quote(k)));
    }
    for (const char* k : {"dtype", "shape", "data_offsets"})
      if (!entry.contains(k)) throw FormatError(fmt::format("{} has no {}", where, k));
    TensorEntry t;
    t.name = name;
    const json& dtype = entry["dtype"];
    if (!dtype.is_string() || !parse_dtype(dtype.get<std::string>(), &t.dtype))
      throw FormatError(fmt::format("{} has an unknown dtype {} (known: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)",
                                    where, dtype.is_string() ? st_quote(dtype.get<std::string>()) : dtype.dump()));
    const json& shape = entry["shape"];
    if (!shape.is_array()) throw FormatError(fmt::format("{}: shape is not a list", where));
    uint64_t bytes_needed = dtype_size(t.dtype);
    bool overflow = false;
    for (const auto& d : shape) {
      uint64_t dim = st_unsigned(d, where + ": a dimension");
      if (dim > static_cast<uint64_t>(INT64_MAX)) throw FormatError(fmt::format("{}: a dimension is too large", where));
      t.shape.push_back(static_cast<int64_t>(dim));
      overflow = overflow || __builtin_mul_overflow(bytes_needed, dim, &bytes_needed);
    }
    const json& offsets = entry["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2)
      throw FormatError(fmt::format("{}: data_offsets is not a [begin, end] pair", where));
    t.begin = st_unsigned(offsets[0], where + ": data_offsets");
    t.end = st_unsigned(offsets[1], where + ": data_offsets");
    if (t.begin > t.end) throw FormatError(fmt::format("{}: data_offsets [{}, {}] end before they begin", where, t.begin, t.end));
    if (t.end > buffer)
      throw FormatError(fmt::format("{}: data_offsets [{}, {}] are beyond the data buffer's {} bytes", where, t.begin,
                                    t.end, buffer));
    if (overflow || bytes_needed != t.end - t.begin)
      throw FormatError(fmt::format("{}: shape [{}] of {} is {} bytes, but data_offsets [{}, {}] hold {}", where,
                                    fmt::join(t.shape, ", "), dtype_name(t.dtype),
                                    overflow ? std::string("more than 2^64") : std::to_string(bytes_needed), t.begin,
                                    t.end, t.end - t.begin));
    header.tensors.push_back(std::move(t));
  }

  // The tensors tile the buffer exactly: no overlap, no gap, no trailing bytes.
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  const TensorEntry* previous = nullptr;
  for (const auto& t : header.tensors) {
    if (t.begin < at)
      throw FormatError(fmt::format("tensor {} (data_offsets [{}, {}]) overlaps tensor {} (ending at {})",
                                    st_quote(t.name), t.begin, t.end, st_quote(previous->name), at));
    if (t.begin > at)
      throw FormatError(fmt::format("bytes [{}, {}) of the data buffer belong to no tensor", at, t.begin));
    at = t.end;
    previous = &t;
  }
  if (at != buffer) throw FormatError(fmt::format("bytes [{}, {}) of the data buffer belong to no tensor", at, buffer));
  return header;
}

std::string encode_header(std::vector<TensorEntry>& tensors, const std::map<std::string, std::string>& metadata) {
  json doc = json::object();
  if (!metadata.empty()) doc["__metadata__"] = metadata;
  uint64_t at = 0;
  for (auto& t : tensors) {
    if (t.name == "__metadata__") throw FormatError("a tensor cannot be named __metadata__");
    if (doc.contains(t.name)) throw FormatError(fmt::format("the name {} appears twice", st_quote(t.name)));
    uint64_t bytes = dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0) throw FormatError(fmt::format("tensor {} has a negative dimension", st_quote(t.name)));
      bytes *= static_cast<uint64_t>(d);
    }
    t.begin = at;
    t.end = at + bytes;
    at = t.end;
    doc[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  std::string text = doc.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace strobe::safetensors
