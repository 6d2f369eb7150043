// safetensors, the weights format that timm, torchvision users, Hugging Face transformers and vLLM read
// and write: u64 little-endian N | N bytes of JSON header | the data buffer. The header maps each
// tensor's name to {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]} (byte offsets into
// the buffer, C order, little-endian) and may hold "__metadata__": {string: string}. No pickle: a
// file holds data only.
//
// This file parses and checks a header without torch (the libFuzzer target tests/fuzz/
// safetensors_fuzz.cpp compiles it alone); strobe/checkpoint/safetensors.h reads and writes
// tensors with it. A file that breaks any rule below is refused with one FormatError naming the rule:
// header length beyond the file or above kMaxHeaderBytes, JSON that does not parse or nests deeper
// than an entry, a duplicate name (or key), an unknown dtype, a shape or offsets that are not
// non-negative integers, a shape whose byte size differs from its offsets, offsets out of the buffer,
// overlapping, or leaving a byte of the buffer uncovered.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace strobe::safetensors {

enum class DType : uint8_t { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

const char* dtype_name(DType dtype);  // "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"
size_t dtype_size(DType dtype);       // bytes per element
bool parse_dtype(const std::string& name, DType* out);

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

struct FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data buffer
};

struct Header {
  std::vector<TensorEntry> tensors;  // in buffer order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // the buffer's offset in the file: 8 + header length
};

// Checks a whole file's bytes (`size` of them) and returns its header; every entry's bytes lie in
// [data_start + begin, data_start + end) within the file. Throws FormatError.
Header parse_header(const char* bytes, uint64_t size);

// The bytes that precede the data of `tensors` written back to back in this order: the 8-byte
// length and the JSON header, padded with spaces to a multiple of 8 bytes (as the safetensors
// package writes it, so the buffer starts 8-byte aligned). Sets each entry's begin/end.
// Throws FormatError for a duplicate name, a negative dimension or a metadata key "__metadata__".
std::string encode_header(std::vector<TensorEntry>& tensors, const std::map<std::string, std::string>& metadata);

}  // namespace strobe::safetensors
