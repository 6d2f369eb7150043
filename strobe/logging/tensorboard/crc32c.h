#pragma once
// CRC-32C (Castagnoli), as TFRecord framing uses it, and TensorFlow's masking of stored CRCs.
#include <cstddef>
#include <cstdint>

namespace strobe::logging::tensorboard {

uint32_t crc32c(const void* data, size_t size);
// TensorFlow's crc32c::Mask: rotate right by 15 bits and add a constant, so that a CRC computed
// over data that itself embeds CRCs stays well distributed.
inline uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace strobe::logging::tensorboard
