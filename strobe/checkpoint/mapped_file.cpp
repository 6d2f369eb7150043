#include "strobe/checkpoint/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "strobe/checkpoint/checkpoint_io.h"

namespace strobe::checkpoint {

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISREG(mode)) return "";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a file";
}

// The files mapped now, for mapped_file_at (the SIGBUS handler's question: which file?). Fixed slots
// of plain memory, read without a lock.
struct MapSlot {
  std::atomic<int> state{0};  // 0 free, 1 being filled, 2 in use
  const char* begin = nullptr;
  uint64_t size = 0;
  char path[1024] = {};
};
MapSlot g_maps[256];

int track_mapping(const char* begin, uint64_t size, const std::string& path) {
  for (int i = 0; i < 256; ++i) {
    int expected = 0;
    if (!g_maps[i].state.compare_exchange_strong(expected, 1)) continue;
    g_maps[i].begin = begin;
    g_maps[i].size = size;
    const size_t n = std::min(path.size(), sizeof g_maps[i].path - 1);
    std::memcpy(g_maps[i].path, path.data(), n);
    g_maps[i].path[n] = '\0';
    g_maps[i].state.store(2);
    return i;
  }
  return -1;  // more mappings than slots: a SIGBUS there is reported without the file's name
}

}  // namespace

std::string non_regular_kind(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  return kind_of(st.st_mode);
}

MappedFile::MappedFile(const std::string& path, const std::string& kind) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    throw CheckpointError(fmt::format("{}: cannot open{}{} ({})", path, kind.empty() ? "" : " ", kind, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw CheckpointError(fmt::format("{}: is {}, not a regular file", path, kind_of(st.st_mode)));
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw CheckpointError(fmt::format("{}: cannot map ({})", path, std::strerror(err)));
    }
    data_ = static_cast<const char*>(p);
    slot_ = track_mapping(data_, size_, path);
  }
  ::close(fd);
}

const char* mapped_file_at(const void* address) noexcept {
  const char* at = static_cast<const char*>(address);
  for (auto& slot : g_maps)
    if (slot.state.load() == 2 && at >= slot.begin && at < slot.begin + slot.size) return slot.path;
  return nullptr;
}

MappedFile::~MappedFile() {
  if (slot_ >= 0) g_maps[slot_].state.store(0);
  if (data_ != nullptr) ::munmap(const_cast<char*>(data_), size_);
}

void MappedFile::advise_random() const {
  if (data_ != nullptr) ::madvise(const_cast<char*>(data_), size_, MADV_RANDOM);
}

}  // namespace strobe::checkpoint
