// A file's bytes mapped read-only (mmap, MAP_PRIVATE) for the life of the object. Checkpoints,
// safetensors files and token files are read through it: the kernel pages the file in on demand
// (page cache, reclaimable), so reading a multi-GB file holds no second copy of it in the process.
// A mapped file truncated or rewritten while the process reads it raises SIGBUS at the next read of a
// lost page: the stop-signal handlers (strobe/core/signals.h) end the process with one line naming
// the file (mapped_file_at) and exit status 1 (docs/CONFIG.md, "Errors").
#pragma once

#include <cstdint>
#include <string>

namespace strobe::checkpoint {

// What `path` is when it exists and is not a regular file, following symlinks: "a FIFO", "a
// directory", "a character device", "a block device", "a socket"; "" for a regular file or a path
// that cannot be stat'ed (its open says why). Every reader of a file a user names asks this first
// (stat never blocks): a FIFO would block the open or the read forever, a device (/dev/zero) would be
// read until memory runs out; both are refused in one line instead (docs/CONFIG.md, "Limits").
std::string non_regular_kind(const std::string& path);

// The path of the live MappedFile whose bytes hold `address` (null: none). Async-signal-safe.
const char* mapped_file_at(const void* address) noexcept;

class MappedFile {
 public:
  // Throws CheckpointError (checkpoint_io.h) starting with the path: "PATH: cannot open (No such
  // file or directory)", "PATH: is a FIFO, not a regular file", "PATH: cannot map (...)"; `kind`
  // names the file in the first ("cannot open checkpoint (...)"). Opened non-blocking: a FIFO is
  // refused, never waited on.
  explicit MappedFile(const std::string& path, const std::string& kind = "");
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // The bytes; an empty file maps nothing and gives "" with size 0.
  const char* data() const { return data_ != nullptr ? data_ : ""; }
  uint64_t size() const { return size_; }
  // Tells the kernel the reads will be random (no read-ahead): token windows drawn by a sampler.
  void advise_random() const;

 private:
  const char* data_ = nullptr;
  uint64_t size_ = 0;
  int slot_ = -1;  // its entry in the table the SIGBUS handler reads (mapped_file.cpp)
};

}  // namespace strobe::checkpoint
