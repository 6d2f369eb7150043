// JPEG (libjpeg-turbo) and PNG (libpng) decoding to 8-bit pixels, and the encoders the tests and the
// benchmark use to make real files with the same libraries. Every failure is a
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
  int width = 0, height = 0, channels = 0;  // the pixels held: the decoded region (below)
  int full_width = 0, full_height = 0;      // as stored in the file
  int scaled_width = 0, scaled_height = 0;  // the whole image at the decoded scale (full_* / 1, 2, 4 or 8)
  int x0 = 0, y0 = 0;                       // where the held pixels start in the scaled image
  std::vector<uint8_t> pixels;              // height x width x channels, row-major
};

// The part of a stored image a transform reads: the box [x, x + w) x [y, y + h) in the stored image's
// pixels, resampled to out_w x out_h by a filter whose support widens with the downscale factor
// (data/image_transforms.h). w <= 0: the whole image.
struct DecodeRegion {
  double x = 0, y = 0, w = 0, h = 0;
  int out_w = 1, out_h = 1;
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
// With a region, a JPEG is decoded only where the region's resampling reads (its box widened by the
// filter's support and 2 pixels, clamped to the image; libjpeg-turbo's jpeg_crop_scanline widens it to
// whole iMCU columns): the rows above it and below it are entropy-decoded and skipped, without the
// inverse DCT, upsampling and colour conversion, and the columns outside it are never transformed.
// The pixels held are bit for bit the full decode's there (ImageCodec's test), so a transform's output
// does not depend on whether it was used. A file cut short fails whatever the region (one that does
// not end in the end-of-image marker is read to its end); corrupt data fails where the decode reads
// it (above the region's last row), and below it is not read: no pixel of it is used. PNGs decode
// whole.
void decode_image_into(const std::string& bytes, const std::string& path, int channels, double min_scale, Image& out,
                       const DecodeRegion& region = {});

// Encoders (the tests' and the benchmark's fixtures). quality 1..100; subsample_420 for colour JPEGs.
std::string encode_jpeg(const uint8_t* pixels, int width, int height, int channels, int quality, bool subsample_420 = true);
std::string encode_png(const uint8_t* pixels, int width, int height, int channels);

}  // namespace strobe::data
