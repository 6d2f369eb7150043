// JPEG (libjpeg-turbo's TurboJPEG API) and PNG (libpng) decoding to 8-bit pixels, and the encoders
// the tests and the benchmark use to make real files with the same libraries. Every failure is a
// DataError naming the file and what is wrong (unreadable, truncated, not a JPEG/PNG, CMYK, ...).
//
// Pixels match what torchvision's ImageFolder sees (PIL's Image.convert): 3 channels = RGB (alpha and
// tRNS transparency dropped, palettes expanded, 16-bit samples cut to their high byte), 1 channel =
// luminance (a JPEG's Y plane; 0.299 R + 0.587 G + 0.114 B for colour PNGs). JPEGs are decoded with
// the accurate integer IDCT and fancy chroma upsampling (libjpeg's defaults, also torchvision's).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace strobe::data {

// True for .jpg, .jpeg and .png (any case): the files image datasets accept.
bool has_image_extension(const std::string& path);

struct Image {
  int width = 0, height = 0, channels = 0;  // as decoded (smaller than full_* after DCT scaling)
  int full_width = 0, full_height = 0;      // as stored in the file
  std::vector<uint8_t> pixels;              // height x width x channels, row-major
};

// The whole file; DataError naming it when it cannot be read.
std::string read_file_bytes(const std::string& path);

// (width, height) from the header alone (JPEG or PNG, by content).
std::pair<int, int> image_size(const std::string& bytes, const std::string& path);

// Decodes a JPEG or PNG (by content, whatever the extension) to `channels` (1 or 3). For a JPEG with
// min_scale < 1 the decoder may downscale in the DCT domain by 1/2, 1/4 or 1/8 (libjpeg-turbo's SIMD
// scaled IDCTs): the strongest reduction whose factor is still >= min_scale, so the result is never
// smaller than the caller needs. PNGs always decode at full size.
Image decode_image(const std::string& bytes, const std::string& path, int channels, double min_scale = 1.0);
// The same into `out`, reusing its buffer (a loader thread keeps one: no allocation, no page faults).
void decode_image_into(const std::string& bytes, const std::string& path, int channels, double min_scale, Image& out);

// Encoders (the tests' and the benchmark's fixtures). quality 1..100; subsample_420 for colour JPEGs.
std::string encode_jpeg(const uint8_t* pixels, int width, int height, int channels, int quality, bool subsample_420 = true);
std::string encode_png(const uint8_t* pixels, int width, int height, int channels);

}  // namespace strobe::data
