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

// Refuses (RunDirError, one line) a fit into a directory that holds another run, unless `ckpt` lies
// inside it (resuming that run) or `overwrite` (then its run files are removed first).
void check_run_dir_free(const RunDirClaim& claim, const std::string& origin, const std::optional<std::string>& ckpt,
                        bool overwrite);

}  // namespace strobe
