#include "data/image_codec.h"

#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <cctype>
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

std::pair<int, int> jpeg_header(const std::string& bytes, const std::string& path, int* colorspace) {
  int w = 0, h = 0, subsamp = 0, cs = 0;
  if (tjDecompressHeader3(decompressor(), reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), &w, &h, &subsamp,
                          &cs) != 0)
    fail_jpeg(path, fmt::format("header: {}", tjGetErrorStr2(decompressor())));
  if (w <= 0 || h <= 0) fail_jpeg(path, "no frame header");
  if (colorspace) *colorspace = cs;
  return {w, h};
}

void decode_jpeg(const std::string& bytes, const std::string& path, int channels, double min_scale, Image& img) {
  int cs = 0;
  auto [w, h] = jpeg_header(bytes, path, &cs);
  if (cs == TJCS_CMYK || cs == TJCS_YCCK) fail(path, "CMYK/YCCK JPEGs are not supported (convert it to RGB)");
  // Strongest power-of-two reduction that keeps the scale >= min_scale.
  int denom = 1;
  while (denom < 8 && 1.0 / (denom * 2) >= min_scale) denom *= 2;
  img.full_width = w;
  img.full_height = h;
  img.channels = channels;
  img.width = (w + denom - 1) / denom;  // TJSCALED(w, {1, denom})
  img.height = (h + denom - 1) / denom;
  img.pixels.resize(static_cast<size_t>(img.width) * img.height * channels);
  // A warning (e.g. "premature end of data segment": a truncated file) also fails: PIL refuses
  // truncated images too, and a half-grey image would train on garbage.
  if (tjDecompress2(decompressor(), reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), img.pixels.data(),
                    img.width, 0, img.height, channels == 1 ? TJPF_GRAY : TJPF_RGB, 0) != 0)
    fail_jpeg(path, tjGetErrorStr2(decompressor()));
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
  img.width = img.full_width = w;
  img.height = img.full_height = h;
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
  if (is_jpeg(bytes)) return jpeg_header(bytes, path, nullptr);
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

void decode_image_into(const std::string& bytes, const std::string& path, int channels, double min_scale, Image& out) {
  if (channels != 1 && channels != 3) fail(path, fmt::format("cannot decode to {} channels (1 or 3)", channels));
  if (is_jpeg(bytes)) return decode_jpeg(bytes, path, channels, min_scale, out);
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
