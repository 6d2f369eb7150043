#include "strobe/checkpoint/checkpoint_io.h"

#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/mapped_file.h"

namespace strobe::checkpoint {
namespace {

constexpr char kMagic[8] = {'S', 'T', 'R', 'O', 'B', 'E', 'C', 'K'};
constexpr char kEndMagic[8] = {'E', 'N', 'D', 'S', 'T', 'R', 'O', 'B'};
std::function<void(size_t)> g_write_observer;

}  // namespace

void throw_write_error(const std::string& path, const std::string& what, int err) {
  const std::string text = fmt::format("{}: {} ({})", path, what, std::strerror(err));
  if (err == ENOSPC || err == EDQUOT || err == EFBIG || err == EIO) throw WriteError(text);
  throw CheckpointError(text);
}

namespace {

void write_all(int fd, const char* p, size_t n, const std::string& path, size_t& written) {
  constexpr size_t kChunk = 1 << 20;
  while (n > 0) {
    size_t len = std::min(n, kChunk);
    ssize_t w = ::write(fd, p, len);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_write_error(path, "write failed", errno);
    }
    p += w, n -= static_cast<size_t>(w), written += static_cast<size_t>(w);
    if (g_write_observer) g_write_observer(written);
  }
}

template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

torch::Tensor string_to_tensor(const std::string& s) {
  auto t = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

const std::string& CheckpointData::blob(const std::string& k) const {
  auto it = blobs.find(k);
  if (it == blobs.end()) throw CheckpointError(fmt::format("checkpoint lacks '{}'", k));
  return it->second;
}

const torch::Tensor& CheckpointData::tensor(const std::string& k) const {
  auto it = tensors.find(k);
  if (it == tensors.end()) throw CheckpointError(fmt::format("checkpoint lacks tensor '{}'", k));
  return it->second;
}

namespace {

// The temporaries being written, by path, for unlink_pending_temp_files (a signal handler: fixed
// slots of plain memory; a path too long or a 33rd writer at once is simply not tracked).
struct TempSlot {
  std::atomic<int> state{0};  // 0 free, 1 being filled, 2 in use
  char path[4096] = {};
};
TempSlot g_temps[32];

int track_temp(const std::string& path) {
  if (path.size() >= sizeof g_temps[0].path) return -1;
  for (int i = 0; i < 32; ++i) {
    int expected = 0;
    if (!g_temps[i].state.compare_exchange_strong(expected, 1)) continue;
    std::memcpy(g_temps[i].path, path.c_str(), path.size() + 1);
    g_temps[i].state.store(2);
    return i;
  }
  return -1;
}

void untrack_temp(const std::string& path) {
  for (auto& slot : g_temps)
    if (slot.state.load() == 2 && path == slot.path) {
      slot.state.store(0);
      return;
    }
}

}  // namespace

void unlink_pending_temp_files() noexcept {
  for (auto& slot : g_temps)
    if (slot.state.load() == 2) ::unlink(slot.path);
}

PendingWrite::PendingWrite(const std::string& path, const std::vector<ByteSpan>& parts) : path_(path) {
  namespace fs = std::filesystem;
  fs::path target(path);
  fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code mk;
  fs::create_directories(dir, mk);
  if (mk) throw CheckpointError(fmt::format("{}: cannot create directory ({})", dir.string(), mk.message()));
  remove_stale_temp_files(dir.string(), target.filename().string());
  const fs::path tmp = dir / fmt::format(".{}.tmp.{}", target.filename().string(), ::getpid());
  track_temp(tmp.string());  // before it exists: a signal from here on removes it
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    untrack_temp(tmp.string());
    throw_write_error(tmp.string(), "cannot create", err);
  }
  size_t written = 0;
  try {
    // Errors name the target: the temp file is gone when the message is read, the previous file kept.
    for (const ByteSpan& p : parts) write_all(fd, static_cast<const char*>(p.data), p.size, path, written);
    if (::fsync(fd) != 0) throw_write_error(path, "fsync failed", errno);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    untrack_temp(tmp.string());
    throw;
  }
  ::close(fd);
  tmp_ = tmp.string();
}

PendingWrite::~PendingWrite() {
  if (!committed_ && !tmp_.empty()) ::unlink(tmp_.c_str());
  if (!tmp_.empty()) untrack_temp(tmp_);
}

void PendingWrite::commit() {
  namespace fs = std::filesystem;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    committed_ = true;  // nothing left to remove
    throw_write_error(path_, "rename failed", err);
  }
  committed_ = true;
  untrack_temp(tmp_);
  const fs::path target(path_);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_spans_atomic(const std::string& path, const std::vector<ByteSpan>& parts) { PendingWrite(path, parts).commit(); }

namespace {

void write_parts_atomic(const std::string& path, std::initializer_list<const std::string*> parts) {
  std::vector<ByteSpan> spans;
  for (const std::string* p : parts) spans.push_back({p->data(), p->size()});
  write_spans_atomic(path, spans);
}

}  // namespace

void set_write_observer_for_testing(std::function<void(size_t)> observer) { g_write_observer = std::move(observer); }

void save_checkpoint_file(const std::string& path, const CheckpointData& data) {
  torch::serialize::OutputArchive archive;
  // Keys are stored under prefixes so tensors and blobs cannot collide; the key lists make loading
  // independent of the archive's own enumeration order.
  std::string tensor_keys, blob_keys;
  int64_t i = 0;
  for (const auto& kv : data.tensors) {
    archive.write(fmt::format("t{}", i++), kv.second.detach());
    tensor_keys += kv.first + '\n';
  }
  i = 0;
  for (const auto& kv : data.blobs) {
    archive.write(fmt::format("b{}", i++), string_to_tensor(kv.second));
    blob_keys += kv.first + '\n';
  }
  archive.write("tensor_keys", string_to_tensor(tensor_keys));
  archive.write("blob_keys", string_to_tensor(blob_keys));
  std::ostringstream os;
  archive.save_to(os);
  const std::string payload = os.str();

  std::string header(kMagic, 8);
  put<uint32_t>(header, kFormatVersion);
  put<uint64_t>(header, payload.size());
  std::string footer;
  put<uint32_t>(footer, crc32(payload.data(), payload.size()));
  footer.append(kEndMagic, 8);

  write_parts_atomic(path, {&header, &payload, &footer});
}

void write_file_atomic(const std::string& path, const std::string& bytes) { write_parts_atomic(path, {&bytes}); }

TempName temp_name_state(const std::string& name) {
  static const std::regex tmp_re(R"(^\..+\.tmp\.([0-9]+)$)");
  std::smatch m;
  if (!std::regex_match(name, m, tmp_re)) return TempName::kNotTemp;
  const long pid = std::strtol(m[1].str().c_str(), nullptr, 10);
  // A live writer other than this process may still rename its temporary into place.
  if (pid != ::getpid() && pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM)) return TempName::kLiveWriter;
  return TempName::kStale;
}

std::vector<std::string> remove_stale_temp_files(const std::string& dir, const std::string& only_for) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return removed;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file(ec)) continue;
    if (!only_for.empty() && name.compare(1, only_for.size() + 5, only_for + ".tmp.") != 0) continue;
    if (temp_name_state(name) != TempName::kStale) continue;
    if (fs::remove(e.path(), ec)) removed.push_back(name);
  }
  return removed;
}

CheckpointData load_checkpoint_file(const std::string& path) {
  // Mapped, not read: the payload is checked and deserialized in place, so the process holds the
  // loaded tensors and no copy of the file (a bf16-master Llama-1B checkpoint is ~15 GB).
  const MappedFile mapped(path, "checkpoint");
  const char* file = mapped.data();
  const uint64_t size = mapped.size();
  const uint64_t head = 8 + 4 + 8, foot = 4 + 8;
  if (size < head || std::memcmp(file, kMagic, 8) != 0)
    throw CheckpointError(fmt::format("{}: not a Strobe checkpoint (bad magic)", path));
  uint32_t version;
  uint64_t len;
  std::memcpy(&version, file + 8, 4);
  std::memcpy(&len, file + 12, 8);
  if (version != kFormatVersion)
    throw CheckpointError(fmt::format("{}: checkpoint format version {} (this strobe reads {})", path, version, kFormatVersion));
  if (len > size || size != head + len + foot)
    throw CheckpointError(fmt::format("{}: truncated or damaged checkpoint ({} bytes, expected {})", path, size,
                                      head + len + foot));
  uint32_t stored;
  std::memcpy(&stored, file + head + len, 4);
  if (std::memcmp(file + head + len + 4, kEndMagic, 8) != 0 || stored != crc32(file + head, len))
    throw CheckpointError(fmt::format("{}: corrupted checkpoint (checksum mismatch)", path));

  CheckpointData data;
  data.source = path;
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(file + head, len, torch::kCPU);  // tensors are copied out of the mapping
    auto read_keys = [&](const char* name) {
      torch::Tensor t;
      archive.read(name, t);
      std::string s(reinterpret_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
      std::vector<std::string> keys;
      std::stringstream ks(s);
      for (std::string k; std::getline(ks, k);) keys.push_back(k);
      return keys;
    };
    auto tkeys = read_keys("tensor_keys");
    for (size_t i = 0; i < tkeys.size(); ++i) {
      torch::Tensor t;
      archive.read(fmt::format("t{}", i), t);
      data.tensors[tkeys[i]] = t;
    }
    auto bkeys = read_keys("blob_keys");
    for (size_t i = 0; i < bkeys.size(); ++i) {
      torch::Tensor t;
      archive.read(fmt::format("b{}", i), t);
      data.blobs[bkeys[i]] = std::string(reinterpret_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
    }
  } catch (const c10::Error& e) {
    throw CheckpointError(fmt::format("{}: unreadable checkpoint payload: {}", path, e.what_without_backtrace()));
  }
  return data;
}

void remove_checkpoint(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove(path, ec);
  remove_tree(path + kShardFolderSuffix);
}

void remove_tree(const std::string& path) {
  auto remove_entry = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p) == 0 ? 0 : (errno == ENOENT ? 0 : -1); };
  ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

}  // namespace strobe::checkpoint
