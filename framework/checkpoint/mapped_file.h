// A file's bytes mapped read-only (mmap, MAP_PRIVATE) for the life of the object. Checkpoints,
// safetensors files and token files are read through it: the kernel pages the file in on demand
// (page cache, reclaimable), so reading a multi-GB file holds no second copy of it in the process.
#pragma once

#include <cstdint>
#include <string>

namespace strobe::checkpoint {

class MappedFile {
 public:
  // Throws CheckpointError (checkpoint_io.h) starting with the path: "PATH: cannot open (No such
  // file or directory)", "PATH: not a regular file", "PATH: cannot map (...)"; `kind` names the file
  // in the first ("cannot open checkpoint (...)").
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
};

}  // namespace strobe::checkpoint
