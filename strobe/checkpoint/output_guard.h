// The one check every command runs on the files it is about to write, before any work
// (docs/CONFIG.md, "Outputs"):
// - an input of the command (the checkpoint it reads, the config, model.init_from's weights, a data
//   file, the capture being replayed, a file inside a directory it reads) is never replaced,
//   --overwrite or not;
// - any other existing file is replaced only with --overwrite, unless it is the command's own earlier
//   output (a replay report, a bench JSON, a quarantine file: `is_own` recognises it);
// - a directory, a FIFO or a device is never an output file;
// - the output's folder exists and takes the file: a temporary of the name the atomic writer will use
//   is created and removed there, so a folder without write permission, a read-only file system or a
//   name too long for the file system is refused now, not after the work.
// Refusals throw OutputRefused: one line naming the option and the path (exit 2).
#pragma once

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace strobe::checkpoint {

struct OutputRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A path the command reads, and what it is for the message ("the checkpoint being exported").
struct CommandInput {
  std::string what;
  std::string path;
};

struct OutputFile {
  std::string option;  // how the user named it: "-o", "--report", "--json", "--write-quarantine"
  std::string path;
  bool overwrite = false;  // --overwrite was given
  // What the command reads: a file is never the output; below a directory no existing file is replaced.
  std::vector<CommandInput> inputs;
  // Other outputs of the same command: the output is none of them (existing or not).
  std::vector<CommandInput> other_outputs;
  // Whether an existing file is this command's own earlier output (replaced without --overwrite).
  std::function<bool(const std::string& path)> is_own;
  // Names what `is_own` accepts, for the refusal ("a replay report").
  std::string own_kind;
};

// Throws OutputRefused when `out` must not be written (the rules above).
void check_output_file(const OutputFile& out);

// The same for an output directory that receives several files (`strobe export --names hf -o DIR`):
// never the directory of an input, or one holding one; never a run directory or a folder of Strobe
// checkpoints (config.yaml, metrics.csv, *.ckpt, checkpoints/); a directory holding other files
// only with --overwrite; writable, or creatable when missing (its writer creates it).
void check_output_directory(const std::string& option, const std::string& dir, bool overwrite,
                            const std::vector<CommandInput>& inputs);

// Runs `write`, the atomic write of an output check_output_file (or check_output_directory) passed:
// a CheckpointError from it is then the machine's, not the input's (the folder was checked), so it
// becomes a WriteError "OPTION PATH: cannot write it: ..." (exit 1). Other errors pass through.
void write_output(const std::string& option, const std::string& path, const std::function<void()>& write);

// Whether `a` and `b` name the same file: the same inode when both exist (links and other spellings
// included), else the same absolute normalised path.
bool same_path(const std::string& a, const std::string& b);

// Whether `path` is an existing regular file of at most `max_bytes` holding a JSON object for which
// `accept` holds (the `is_own` of JSON outputs; a large file, a checkpoint say, is not read).
bool json_file_where(const std::string& path, const std::function<bool(const nlohmann::json&)>& accept,
                     size_t max_bytes = size_t{64} << 20);

}  // namespace strobe::checkpoint
