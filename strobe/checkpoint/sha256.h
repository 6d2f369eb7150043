// SHA-256 (FIPS 180-4) of bytes and of files: the content hash Strobe records for what a run depends
// on outside its config (plugins), so that a changed file is named, never a silent difference.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace strobe::checkpoint {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  std::string hex_digest();  // 64 lowercase hex digits; the object is spent after this

 private:
  void block(const uint8_t* p);
  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buf_{};
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

std::string sha256_hex(const std::string& bytes);
// The file's SHA-256; throws std::runtime_error naming the file when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace strobe::checkpoint
