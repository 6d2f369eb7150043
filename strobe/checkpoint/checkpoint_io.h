// Checkpoint files: one file holds everything needed to continue a run exactly.
//
// Layout: "STROBECK" | u32 format version | u64 payload length | payload | u32 CRC-32 of payload |
// "ENDSTROB". The payload is a torch serialize archive (tensors keep dtype; CUDA tensors load on CPU).
// Writes are atomic: temp file in the same directory, fsync, rename, fsync of the directory — a crash
// or a full disk during a save never destroys the previous checkpoint. Reads verify magic, version,
// length and checksum before parsing anything: a truncated or corrupted file is refused with a
// message naming it, never half-loaded.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include <torch/types.h>

namespace strobe::checkpoint {

constexpr uint32_t kFormatVersion = 1;

struct CheckpointError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A write that failed at run time (ENOSPC, EDQUOT, EFBIG, EIO: the disk, the quota, the file-size
// limit, the device): not bad input, so every command exits 1 with its one line (docs/CONFIG.md).
// The atomic writers below leave the previous file at the path as it was and remove their temp file.
struct WriteError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The error for a failed write of `path` (errno `err`): WriteError for the errors above, else
// CheckpointError (a path that cannot be written: a missing directory, no permission).
[[noreturn]] void throw_write_error(const std::string& path, const std::string& what, int err);

// A flat, ordered map of named tensors and named byte strings (non-tensor state: cereal/JSON text).
struct CheckpointData {
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, std::string> blobs;
  // Where it came from, for messages: the file load_checkpoint_file read; a checkpoint made in
  // memory is "the checkpoint" unless its maker names it. Not written to the file.
  std::string source = "the checkpoint";

  bool has_blob(const std::string& k) const { return blobs.count(k) > 0; }
  const std::string& blob(const std::string& k) const;    // throws CheckpointError naming the key
  const torch::Tensor& tensor(const std::string& k) const;
};

void save_checkpoint_file(const std::string& path, const CheckpointData& data);

// The same atomic write for any run file (config.yaml, metrics.csv): temp file ".<name>.tmp.<pid>"
// beside `path`, fsync, rename, fsync of the directory. Throws CheckpointError naming the file.
void write_file_atomic(const std::string& path, const std::string& bytes);
// The same, for a file written from several buffers in order (no copy of them is made).
struct ByteSpan {
  const void* data;
  size_t size;
};
void write_spans_atomic(const std::string& path, const std::vector<ByteSpan>& parts);

// The same write in two halves, for an output of several files that must change together (a Hugging
// Face export: model.safetensors and config.json): the constructor writes and fsyncs the temp file,
// commit() renames it into place; destroyed uncommitted, it removes the temp file. So every file is
// written, and every target checked, before the first rename.
class PendingWrite {
 public:
  PendingWrite(const std::string& path, const std::vector<ByteSpan>& parts);
  ~PendingWrite();
  PendingWrite(const PendingWrite&) = delete;
  PendingWrite& operator=(const PendingWrite&) = delete;
  void commit();
  const std::string& path() const { return path_; }

 private:
  std::string path_, tmp_;
  bool committed_ = false;
};

// Unlinks the temporaries being written at this moment (async-signal-safe: the stop-signal handler
// calls it before the process exits, so a command stopped mid-write leaves no temporary behind).
void unlink_pending_temp_files() noexcept;

// What a directory entry named `name` is: not a temporary of an atomic writer (".<name>.tmp.<pid>"),
// one whose writer (another process) still runs, or a stale one (its writer is gone, or is this
// process). remove_stale_temp_files and the NaN capture's cleanup (built the same way) use it.
enum class TempName { kNotTemp, kLiveWriter, kStale };
TempName temp_name_state(const std::string& name);

// Removes the temp files (".<name>.tmp.<pid>") that a writer killed mid-write left in `dir`, skipping
// those of a process that is still running; returns the names removed. Missing `dir`: nothing.
// `only_for`: just the temp files of that file name. Every atomic write does this for its target
// first, so killed writers' temporaries never pile up beside a file written again and again.
std::vector<std::string> remove_stale_temp_files(const std::string& dir, const std::string& only_for = "");

// Removes `path` and everything below it (no error if it does not exist). Use this, never
// std::filesystem::remove_all: the torch wheel's libtorch.so exports its own copy of the
// std::filesystem functions, and its remove_all jumped to a null pointer in our binaries.
void remove_tree(const std::string& path);
CheckpointData load_checkpoint_file(const std::string& path);

// A checkpoint written under trainer.strategy zero2 has the ranks' optimizer shards in a folder
// beside it: <file> + kShardFolderSuffix (docs/DISTRIBUTED.md). remove_checkpoint removes the file
// and that folder (no error when either is missing).
inline constexpr const char* kShardFolderSuffix = ".zero2";
void remove_checkpoint(const std::string& path);

// Called with the number of bytes written so far while the temp file is written (tests use it to
// simulate a crash mid-write by throwing).
void set_write_observer_for_testing(std::function<void(size_t)> observer);

uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);

}  // namespace strobe::checkpoint
