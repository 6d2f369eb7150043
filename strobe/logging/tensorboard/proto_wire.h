#pragma once
// A minimal protobuf (proto3) wire-format writer, enough for TensorBoard's Event/Summary messages.
// Encodes exactly what protobuf's own serializers emit for the same message: fields in increasing
// field-number order (the caller's job), proto3 defaults omitted (the caller's job, except for
// members of a oneof, which are always written), varints for integers and enums, little-endian
// fixed32/fixed64 for float/double, length-delimited strings, bytes and sub-messages.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace strobe::logging::tensorboard {

class ProtoWriter {
 public:
  enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

  void varint_field(uint32_t field, uint64_t value) {
    key(field, kVarint);
    varint(value);
  }
  // int64/int32/enum fields: negative values are ten-byte two's-complement varints, as protobuf does.
  void int64_field(uint32_t field, int64_t value) { varint_field(field, static_cast<uint64_t>(value)); }
  void double_field(uint32_t field, double value) {
    key(field, kFixed64);
    uint64_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    fixed(bits, 8);
  }
  void float_field(uint32_t field, float value) {
    key(field, kFixed32);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    fixed(bits, 4);
  }
  // string, bytes and embedded messages (pass the sub-message's bytes).
  void bytes_field(uint32_t field, std::string_view value) {
    key(field, kLengthDelimited);
    varint(value.size());
    out_.append(value.data(), value.size());
  }

  const std::string& bytes() const { return out_; }
  std::string take() { return std::move(out_); }

 private:
  void key(uint32_t field, WireType type) { varint((static_cast<uint64_t>(field) << 3) | type); }
  void varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<char>(v));
  }
  void fixed(uint64_t bits, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  }
  std::string out_;
};

}  // namespace strobe::logging::tensorboard
