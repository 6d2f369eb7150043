#include "data/idx_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "strobe/data/data_error.h"
#if STROBE_HAVE_ZLIB
#include <zlib.h>
#else
#include <cstdio>
#endif

namespace strobe::data {

std::string read_maybe_gzipped(const std::string& path) {
  require_regular_file(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("{}: cannot open ({})", path, std::strerror(errno)));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string raw = ss.str();
  if (raw.size() < 2 || static_cast<unsigned char>(raw[0]) != 0x1f || static_cast<unsigned char>(raw[1]) != 0x8b)
    return raw;
#if STROBE_HAVE_ZLIB
  z_stream zs{};
  if (inflateInit2(&zs, 15 + 32) != Z_OK) throw DataError(fmt::format("{}: zlib init failed", path));
  zs.next_in = reinterpret_cast<Bytef*>(raw.data());
  zs.avail_in = static_cast<uInt>(raw.size());
  std::string out;
  char buf[1 << 16];
  int rc;
  do {
    zs.next_out = reinterpret_cast<Bytef*>(buf);
    zs.avail_out = sizeof(buf);
    rc = inflate(&zs, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END) {
      inflateEnd(&zs);
      throw DataError(fmt::format("{}: corrupt or truncated gzip data", path));
    }
    out.append(buf, sizeof(buf) - zs.avail_out);
  } while (rc != Z_STREAM_END && (zs.avail_in > 0 || zs.avail_out == 0));
  inflateEnd(&zs);
  if (rc != Z_STREAM_END) throw DataError(fmt::format("{}: truncated gzip data", path));
  return out;
#else
  std::string quoted = "'";
  for (char ch : path) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  quoted += "'";
  FILE* pipe = ::popen(("gzip -dc " + quoted + " 2>/dev/null").c_str(), "r");
  if (!pipe) throw DataError(fmt::format("{}: cannot run gzip to decompress it", path));
  std::string out;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, n);
  if (::pclose(pipe) != 0) throw DataError(fmt::format("{}: corrupt or truncated gzip data", path));
  return out;
#endif
}

torch::Tensor read_idx_file(const std::string& path) {
  std::string data = read_maybe_gzipped(path);
  auto byte = [&](size_t i) { return static_cast<unsigned char>(data[i]); };
  if (data.size() < 4 || byte(0) != 0 || byte(1) != 0)
    throw DataError(fmt::format("{}: not an IDX file (wrong magic number)", path));
  if (byte(2) != 0x08)
    throw DataError(fmt::format("{}: IDX element type 0x{:02x} is not supported (expected unsigned bytes, 0x08)", path, byte(2)));
  int ndim = byte(3);
  if (ndim < 1 || ndim > 4) throw DataError(fmt::format("{}: IDX file with {} dimensions", path, ndim));
  if (data.size() < 4 + 4 * static_cast<size_t>(ndim)) throw DataError(fmt::format("{}: truncated IDX header", path));
  std::vector<int64_t> shape;
  // The product of up to four 32-bit dimensions can pass 2^64: multiply with overflow checks, so a
  // corrupt header is reported as such instead of wrapping (to a bogus size, or to 0 and passing).
  uint64_t count = 1;
  bool overflow = false;
  for (int d = 0; d < ndim; ++d) {
    size_t o = 4 + 4 * d;
    int64_t n = (int64_t(byte(o)) << 24) | (int64_t(byte(o + 1)) << 16) | (int64_t(byte(o + 2)) << 8) | int64_t(byte(o + 3));
    shape.push_back(n);
    overflow = overflow || __builtin_mul_overflow(count, static_cast<uint64_t>(n), &count);
  }
  const size_t header = 4 + 4 * static_cast<size_t>(ndim);
  const uint64_t body = data.size() - header;
  if (overflow || body < count) {
    std::string dims = fmt::format("{}", fmt::join(shape, " x "));
    throw DataError(overflow ? fmt::format("{}: corrupt IDX header: dimensions {} overflow 64 bits (the file has {} bytes of data)", path, dims, body)
                             : fmt::format("{}: truncated IDX file: header dimensions {} need {} bytes, file has {}", path, dims, count, body));
  }
  auto t = torch::empty(shape, torch::kUInt8);
  std::memcpy(t.data_ptr(), data.data() + header, count);
  return t;
}

}  // namespace strobe::data
