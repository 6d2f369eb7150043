#include "data/image_codec.h"

#include <png.h>
#include <turbojpeg.h>
// jpeglib.h needs FILE and size_t declared before it.
#include <cstdio>
#include <jpeglib.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "strobe/data/data_error.h"

namespace strobe::data {
namespace {

bool is_jpeg(const std::string& b) {
  return b.size() >= 3 && static_cast<uint8_t>(b[0]) == 0xFF && static_cast<uint8_t>(b[1]) == 0xD8 &&
         static_cast<uint8_t>(b[2]) == 0xFF;
}
bool is_png(const std::string& b) { return b.size() >= 8 && std::memcmp(b.data(), "\x89PNG\r\n\x1a\n", 8) == 0; }

// One TurboJPEG handle per thread and direction (creating one allocates; loader threads reuse theirs).
struct TjHandle {
  tjhandle h;
  explicit TjHandle(bool decompress) : h(decompress ? tjInitDecompress() : tjInitCompress()) {}
  ~TjHandle() {
    if (h) tjDestroy(h);
  }
};
TjHandle& decompressor_slot() {
  thread_local TjHandle t(true);
  return t;
}
tjhandle decompressor() { return decompressor_slot().h; }
// After a failure a handle can keep state from the bad stream (a tables-only header then reads as
// an empty image); the error text is taken first, then the handle is replaced.
[[noreturn]] void fail_jpeg(const std::string& path, const std::string& what) {
  std::string msg = fmt::format("{}: truncated or corrupt JPEG ({})", path, what);
  TjHandle& slot = decompressor_slot();
  tjDestroy(slot.h);
  slot.h = tjInitDecompress();
  throw DataError(msg);
}
tjhandle compressor() {
  thread_local TjHandle t(false);
  return t.h;
}

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw DataError(fmt::format("{}: {}", path, what)); }

std::pair<int, int> jpeg_header(const std::string& bytes, const std::string& path) {
  int w = 0, h = 0, subsamp = 0, cs = 0;
  if (tjDecompressHeader3(decompressor(), reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), &w, &h, &subsamp,
                          &cs) != 0)
    fail_jpeg(path, fmt::format("header: {}", tjGetErrorStr2(decompressor())));
  if (w <= 0 || h <= 0) fail_jpeg(path, "no frame header");
  return {w, h};
}

// ---- JPEG decoding through libjpeg's API (TurboJPEG 2.x cannot decode a part of an image). Errors
// and warnings (a corrupt or truncated stream: "premature end of data segment") longjmp back to
// jpeg_decode_raw with the library's message; PIL refuses truncated images too, and a half-grey image
// would train on garbage.
struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char msg[JMSG_LENGTH_MAX];
};
void jpeg_on_error(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegError*>(c->err);
  (*c->err->format_message)(c, e->msg);
  std::longjmp(e->jump, 1);
}
void jpeg_on_message(j_common_ptr c, int level) {
  if (level < 0) jpeg_on_error(c);  // a warning: corrupt data
}

// One decompressor per thread (creating one allocates; loader threads reuse theirs).
struct JpegDecoder {
  jpeg_decompress_struct info{};
  JpegError err{};
  JpegDecoder() {
    info.err = jpeg_std_error(&err.mgr);
    err.mgr.error_exit = jpeg_on_error;
    err.mgr.emit_message = jpeg_on_message;
    jpeg_create_decompress(&info);
  }
  ~JpegDecoder() { jpeg_destroy_decompress(&info); }
};

// The rows or columns [lo, hi) of a side of `scaled` pixels (the image's side `full`) that resampling
// the box [start, start + len) (stored pixels) to `out` pixels reads: the bilinear filter's support is
// max(1, len / out) scaled pixels either side of the box; 2 more for fancy upsampling, which treats the
// edge of a decoded part as the image's edge.
std::pair<int, int> needed_span(double start, double len, int out, int full, int scaled) {
  if (len <= 0) return {0, scaled};
  const double s = static_cast<double>(scaled) / full, a = start * s, n = len * s;
  const double support = std::max(1.0, n / std::max(out, 1));
  const int lo = static_cast<int>(std::floor(a - support)) - 2, hi = static_cast<int>(std::ceil(a + n + support)) + 3;
  return {std::clamp(lo, 0, scaled), std::clamp(hi, 0, scaled)};
}

enum class JpegDecode { kOk, kCorrupt, kCmyk };

// kCorrupt with err.msg set on any libjpeg error or warning; kCmyk for a CMYK/YCCK file (from the
// header this decode reads anyway). Only trivially destructible locals
// live in this frame (a longjmp skips destructors); `img` belongs to the caller.
JpegDecode jpeg_decode_raw(JpegDecoder& d, const std::string& bytes, int channels, double min_scale, const DecodeRegion& region,
                           Image& img) {
  jpeg_decompress_struct* c = &d.info;
  if (setjmp(d.err.jump)) {
    jpeg_abort_decompress(c);
    return JpegDecode::kCorrupt;
  }
  jpeg_mem_src(c, reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size()));
  if (jpeg_read_header(c, TRUE) != JPEG_HEADER_OK || c->image_width == 0 || c->image_height == 0) {
    std::snprintf(d.err.msg, sizeof(d.err.msg), "no frame header");
    jpeg_abort_decompress(c);
    return JpegDecode::kCorrupt;
  }
  if (c->jpeg_color_space == JCS_CMYK || c->jpeg_color_space == JCS_YCCK) {
    jpeg_abort_decompress(c);
    return JpegDecode::kCmyk;
  }
  // Strongest power-of-two reduction that keeps the scale >= min_scale.
  int denom = 1;
  while (denom < 8 && 1.0 / (denom * 2) >= min_scale) denom *= 2;
  c->scale_num = 1;
  c->scale_denom = static_cast<unsigned>(denom);
  c->out_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_start_decompress(c);
  img.full_width = static_cast<int>(c->image_width);
  img.full_height = static_cast<int>(c->image_height);
  img.scaled_width = static_cast<int>(c->output_width);
  img.scaled_height = static_cast<int>(c->output_height);
  img.channels = channels;
  const auto [x_lo, x_hi] = needed_span(region.x, region.w, region.out_w, img.full_width, img.scaled_width);
  const auto [y_lo, y_hi] = needed_span(region.y, region.h, region.out_h, img.full_height, img.scaled_height);
  JDIMENSION xoff = 0, width = c->output_width;
  if (x_lo > 0 || x_hi < img.scaled_width) {
    xoff = static_cast<JDIMENSION>(x_lo);
    width = static_cast<JDIMENSION>(x_hi - x_lo);
    jpeg_crop_scanline(c, &xoff, &width);  // widened to whole iMCU columns
  }
  img.x0 = static_cast<int>(xoff);
  img.y0 = y_lo;
  img.width = static_cast<int>(width);
  img.height = y_hi - y_lo;
  img.pixels.resize(static_cast<size_t>(img.width) * img.height * channels);
  if (y_lo > 0) jpeg_skip_scanlines(c, static_cast<JDIMENSION>(y_lo));
  const size_t stride = static_cast<size_t>(img.width) * channels;
  while (c->output_scanline < static_cast<JDIMENSION>(y_hi)) {
    JSAMPROW row = img.pixels.data() + (c->output_scanline - y_lo) * stride;
    jpeg_read_scanlines(c, &row, 1);
  }
  // The rows below: a file that ends in the end-of-image marker is left there (jpeg_skip_scanlines to
  // the bottom reads nothing more); any other (cut short, or with bytes after its image) is read to
  // its end, its last row decoded, so a cut file fails whatever the region.
  const bool ends_with_eoi = bytes.size() >= 2 && static_cast<uint8_t>(bytes[bytes.size() - 2]) == 0xFF &&
                             static_cast<uint8_t>(bytes.back()) == JPEG_EOI;
  if (!ends_with_eoi && c->output_scanline + 1 < c->output_height) jpeg_skip_scanlines(c, c->output_height - 1 - c->output_scanline);
  if (!ends_with_eoi && c->output_scanline < c->output_height) {
    thread_local std::vector<uint8_t> last_row;  // decoded and dropped
    last_row.resize(static_cast<size_t>(img.width) * channels);
    JSAMPROW row = last_row.data();
    jpeg_read_scanlines(c, &row, 1);
  }
  if (c->output_scanline < c->output_height) jpeg_skip_scanlines(c, c->output_height - c->output_scanline);
  jpeg_finish_decompress(c);
  return JpegDecode::kOk;
}

void decode_jpeg(const std::string& bytes, const std::string& path, int channels, double min_scale, const DecodeRegion& region,
                 Image& img) {
  thread_local JpegDecoder decoder;
  switch (jpeg_decode_raw(decoder, bytes, channels, min_scale, region, img)) {
    case JpegDecode::kOk:
      return;
    case JpegDecode::kCmyk:
      fail(path, "CMYK/YCCK JPEGs are not supported (convert it to RGB)");
    case JpegDecode::kCorrupt:
      fail(path, fmt::format("truncated or corrupt JPEG ({})", decoder.err.msg));
  }
}

// ---- PNG (libpng's classic API: its transforms reproduce PIL's convert; errors longjmp back here)
struct PngSource {
  const uint8_t* data;
  size_t size, pos;
};
struct PngError {
  char msg[256];
};
void png_read_mem(png_structp png, png_bytep out, png_size_t n) {
  auto* s = static_cast<PngSource*>(png_get_io_ptr(png));
  if (s->pos + n > s->size) png_error(png, "unexpected end of file (truncated)");
  std::memcpy(out, s->data + s->pos, n);
  s->pos += n;
}
void png_on_error(png_structp png, png_const_charp msg) {
  auto* e = static_cast<PngError*>(png_get_error_ptr(png));
  std::snprintf(e->msg, sizeof(e->msg), "%s", msg);
  png_longjmp(png, 1);
}
void png_on_warning(png_structp, png_const_charp) {}

// Returns false with err filled on a libpng error. No C++ object is created between setjmp and a
// longjmp in this frame: `out` and `rows` live in the caller.
bool png_decode_raw(const std::string& bytes, int channels, std::vector<uint8_t>* out, std::vector<png_bytep>* rows, int* width,
                    int* height, PngError* err) {
  PngSource src{reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), 0};
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, err, png_on_error, png_on_warning);
  if (!png) return std::snprintf(err->msg, sizeof(err->msg), "out of memory"), false;
  png_infop info = png_create_info_struct(png);
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, info ? &info : nullptr, nullptr);
    return false;
  }
  png_set_read_fn(png, &src, png_read_mem);
  png_read_info(png, info);
  const int color = png_get_color_type(png, info), depth = png_get_bit_depth(png, info);
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  if (depth == 16) png_set_strip_16(png);
  if (color & PNG_COLOR_MASK_ALPHA) png_set_strip_alpha(png);
  const bool gray = color == PNG_COLOR_TYPE_GRAY || color == PNG_COLOR_TYPE_GRAY_ALPHA;
  if (channels == 3 && gray) png_set_gray_to_rgb(png);
  if (channels == 1 && !gray) png_set_rgb_to_gray_fixed(png, 1, 29900, 58700);  // ITU-R 601 luma, as PIL's "L"
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  *width = static_cast<int>(png_get_image_width(png, info));
  *height = static_cast<int>(png_get_image_height(png, info));
  if (static_cast<int>(png_get_channels(png, info)) != channels) png_error(png, "unexpected channel count after conversion");
  out->resize(static_cast<size_t>(*width) * *height * channels);
  rows->resize(*height);
  for (int y = 0; y < *height; ++y) (*rows)[y] = out->data() + static_cast<size_t>(y) * *width * channels;
  png_read_image(png, rows->data());
  png_read_end(png, nullptr);  // a file cut after its pixel data still fails here
  png_destroy_read_struct(&png, &info, nullptr);
  return true;
}

void decode_png(const std::string& bytes, const std::string& path, int channels, Image& img) {
  std::vector<png_bytep> rows;
  PngError err{};
  int w = 0, h = 0;
  if (!png_decode_raw(bytes, channels, &img.pixels, &rows, &w, &h, &err)) fail(path, fmt::format("truncated or corrupt PNG ({})", err.msg));
  img.width = img.full_width = img.scaled_width = w;
  img.height = img.full_height = img.scaled_height = h;
  img.channels = channels;
}

void png_write_mem(png_structp png, png_bytep data, png_size_t n) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), n);
}
void png_flush_mem(png_structp) {}

}  // namespace

bool has_image_extension(const std::string& path) {
  auto dot = path.find_last_of('.');
  if (dot == std::string::npos || path.find('/', dot) != std::string::npos) return false;
  std::string ext = path.substr(dot + 1);
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext == "jpg" || ext == "jpeg" || ext == "png";
}

std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, fmt::format("cannot open ({})", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail(path, "read failed");
  return ss.str();
}

std::pair<int, int> image_size(const std::string& bytes, const std::string& path) {
  if (is_jpeg(bytes)) return jpeg_header(bytes, path);
  if (is_png(bytes)) {
    if (bytes.size() < 24 || std::memcmp(bytes.data() + 12, "IHDR", 4) != 0) fail(path, "truncated or corrupt PNG (no IHDR chunk)");
    auto be32 = [&](size_t o) {
      return (uint32_t(uint8_t(bytes[o])) << 24) | (uint32_t(uint8_t(bytes[o + 1])) << 16) | (uint32_t(uint8_t(bytes[o + 2])) << 8) |
             uint32_t(uint8_t(bytes[o + 3]));
    };
    const uint32_t w = be32(16), h = be32(20);
    if (w == 0 || h == 0 || w > (1u << 24) || h > (1u << 24)) fail(path, fmt::format("PNG header with size {}x{}", w, h));
    return {static_cast<int>(w), static_cast<int>(h)};
  }
  if (bytes.empty()) fail(path, "empty file (not a JPEG or PNG image)");
  fail(path, "not a JPEG or PNG image (unrecognised content)");
}

void decode_image_into(const std::string& bytes, const std::string& path, int channels, double min_scale, Image& out,
                       const DecodeRegion& region) {
  if (channels != 1 && channels != 3) fail(path, fmt::format("cannot decode to {} channels (1 or 3)", channels));
  out.x0 = out.y0 = 0;
  if (is_jpeg(bytes)) return decode_jpeg(bytes, path, channels, min_scale, region, out);
  if (is_png(bytes)) return decode_png(bytes, path, channels, out);
  if (bytes.empty()) fail(path, "empty file (not a JPEG or PNG image)");
  fail(path, "not a JPEG or PNG image (unrecognised content)");
}

Image decode_image(const std::string& bytes, const std::string& path, int channels, double min_scale) {
  Image img;
  decode_image_into(bytes, path, channels, min_scale, img);
  return img;
}

std::string encode_jpeg(const uint8_t* pixels, int width, int height, int channels, int quality, bool subsample_420) {
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const int samp = channels == 1 ? TJSAMP_GRAY : subsample_420 ? TJSAMP_420 : TJSAMP_444;
  if (tjCompress2(compressor(), pixels, width, 0, height, channels == 1 ? TJPF_GRAY : TJPF_RGB, &buf, &size, samp, quality, 0) != 0)
    throw DataError(fmt::format("JPEG encoding failed: {}", tjGetErrorStr2(compressor())));
  std::string out(reinterpret_cast<const char*>(buf), size);
  tjFree(buf);
  return out;
}

std::string encode_png(const uint8_t* pixels, int width, int height, int channels) {
  std::string out;
  PngError err{};
  std::vector<png_const_bytep> rows(height);
  for (int y = 0; y < height; ++y) rows[y] = pixels + static_cast<size_t>(y) * width * channels;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &err, png_on_error, png_on_warning);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, info ? &info : nullptr);
    throw DataError(fmt::format("PNG encoding failed: {}", err.msg));
  }
  png_set_write_fn(png, &out, png_write_mem, png_flush_mem);
  png_set_IHDR(png, info, width, height, 8, channels == 1 ? PNG_COLOR_TYPE_GRAY : PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  png_write_image(png, const_cast<png_bytepp>(rows.data()));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

}  // namespace strobe::data
