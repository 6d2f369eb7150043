// The run directory of a fit: claimed, locked and checked before anything is written to it.
//
// - `<default_root_dir>/<name>/version_<n>` is claimed with mkdir (no -p): the process whose mkdir
//   succeeds owns the number; one that finds it taken (EEXIST) tries the next. Runs started at the
//   same time under one root therefore never share a directory.
// - The run directory is locked for the run's lifetime with flock on its own file descriptor (no
//   lock file): a second writer is refused while the first runs, and the kernel drops the lock
//   when a run dies (kill -9 leaves no stale lock). Under DDP rank 0 holds it.
// - A directory that already holds a run (config.yaml, metrics.csv or a checkpoint) is refused
//   unless the fit resumes from a checkpoint inside it, or the user passed --overwrite (which removes
//   the files a run writes there, and nothing else).
// - A claim that is still empty when it is released (a run refused before it wrote anything) is
//   removed, with the parent directories the claim created.
#pragma once

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace strobe {

// The run directory cannot be created, written or claimed (read-only file system, a path through a
// file, another run in it): a usage error, reported before any work starts.
struct RunDirError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class RunDirClaim {
 public:
  // Claims the next free `<root>/<name>/version_<n>`.
  static RunDirClaim next_version(const std::string& root, const std::string& name);
  // Claims `dir` (created when missing). `origin` starts every error ("--run-dir").
  static RunDirClaim at(const std::string& dir, const std::string& origin);

  RunDirClaim(RunDirClaim&& o) noexcept;
  RunDirClaim& operator=(RunDirClaim&&) = delete;
  RunDirClaim(const RunDirClaim&) = delete;
  ~RunDirClaim();

  const std::string& dir() const { return dir_; }

  // The run files `dir` already holds (config.yaml, metrics.csv, checkpoints/*.ckpt), relative to it.
  std::vector<std::string> run_files() const;
  // Removes the files a run writes (config.yaml, metrics.csv, checkpoints/*.ckpt, the NaN captures
  // nan/step_<N>, TensorBoard events.out.tfevents.*) and nothing else.
  void remove_run_files() const;

 private:
  RunDirClaim(std::string dir, std::string created_top, std::string origin);
  void lock();
  std::string dir_;
  std::string created_top_;  // the outermost directory this claim created ("" when none)
  std::string origin_;
  int fd_ = -1;
};

// A checkpoint directory outside the run directory (`model_checkpoint.dirpath` elsewhere), claimed for
// the run as the run directory is, so that no run replaces another's checkpoints:
// - refused when it lies inside another run's directory (one holding config.yaml or metrics.csv, or
//   locked by a live run), e.g. another run's checkpoints/;
// - locked for the run's lifetime (flock on the directory itself): a second live run is refused;
// - owned: `.strobe-owner` in it names the run directory whose checkpoints it holds. A directory
//   owned by another run, or holding *.ckpt files of no known owner, is refused unless the fit
//   resumes from a checkpoint inside it (the run then takes it over) or --overwrite (its *.ckpt
//   files are removed first, and nothing else).
// A claim that created the directory and left nothing but its owner file is removed with it.
class CheckpointDirClaim {
 public:
  // `origin` names the key ("callbacks[1].dirpath"); `run_dir` is this run's (claimed) directory.
  // Returns nullptr when `dir` lies inside `run_dir` (the run directory's claim covers it).
  static std::unique_ptr<CheckpointDirClaim> claim(const std::string& dir, const std::string& run_dir,
                                                   const std::string& origin, const std::optional<std::string>& ckpt,
                                                   bool overwrite);
  CheckpointDirClaim(const CheckpointDirClaim&) = delete;
  CheckpointDirClaim& operator=(const CheckpointDirClaim&) = delete;
  ~CheckpointDirClaim();

  const std::string& dir() const { return dir_; }
  static constexpr const char* kOwnerFile = ".strobe-owner";

 private:
  CheckpointDirClaim(std::string dir, std::string created_top) : dir_(std::move(dir)), created_top_(std::move(created_top)) {}
  std::string dir_;
  std::string created_top_;
  int fd_ = -1;
};

// Refuses (RunDirError, one line) a fit into a directory that holds another run, unless `ckpt` lies
// inside it (resuming that run) or `overwrite` (then its run files are removed first).
void check_run_dir_free(const RunDirClaim& claim, const std::string& origin, const std::optional<std::string>& ckpt,
                        bool overwrite);

}  // namespace strobe
