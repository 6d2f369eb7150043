// Reading and writing safetensors files (strobe/checkpoint/safetensors_format.h has the format
// and its checks). Reads map the file and copy every tensor out (offsets are only 8-byte aligned in
// practice, and nothing may keep the mapping); writes are atomic like checkpoints (temp file, fsync,
// rename, directory fsync). Tensor dtypes: float64/32/16, bfloat16, int64/32/16/8, uint8, bool.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "strobe/checkpoint/checkpoint_io.h"

namespace strobe::safetensors {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

struct File {
  NamedTensors tensors;  // in the file's buffer order; CPU, contiguous, owning their memory
  std::map<std::string, std::string> metadata;
  std::vector<std::string> unmapped_bool;  // map_file: the BOOL tensors it leaves out (their bytes are unchecked)
};

// Throws checkpoint::CheckpointError "PATH: not a safetensors file: <what>" (or the I/O problem).
File read_file(const std::string& path);
// The same file memory-mapped: CPU tensors over the mapping itself (read-only memory: never write
// them), which stays mapped while any of them lives. Nothing is read until a tensor's bytes are.
// BOOL tensors are not offered (their bytes are not checked); the same errors as read_file.
File map_file(const std::string& path);

// Writes `tensors` (any device; made contiguous on the CPU) in the given order, with `metadata` as
// __metadata__. Throws checkpoint::CheckpointError naming the file and the problem (a duplicate name,
// a dtype safetensors has no code for, an I/O error); a failed write leaves an existing file as it was.
void write_file(const std::string& path, const NamedTensors& tensors,
                const std::map<std::string, std::string>& metadata = {});
// The same, written to its temp file only: commit() puts it in place (checkpoint::PendingWrite).
std::unique_ptr<checkpoint::PendingWrite> prepare_file(const std::string& path, const NamedTensors& tensors,
                                                       const std::map<std::string, std::string>& metadata = {});

}  // namespace strobe::safetensors
