#include "runner/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "strobe/checkpoint/checkpoint_io.h"

namespace strobe {
namespace fs = std::filesystem;

namespace {

// The outermost missing directory on the way to `p` ("" when `p` exists).
std::string outermost_missing(const fs::path& p) {
  std::error_code ec;
  fs::path top;
  for (fs::path q = fs::absolute(p, ec).lexically_normal(); !q.empty() && !fs::exists(q, ec); q = q.parent_path()) {
    top = q;
    if (q == q.parent_path()) break;
  }
  return top.string();
}

// Errors name `shown`: the `noun` ("run directory") the user would have got.
void create_dirs(const fs::path& p, const std::string& origin, const std::string& shown, const char* noun = "run directory") {
  std::error_code ec;
  if (fs::exists(p, ec) && !fs::is_directory(p, ec))
    throw RunDirError(fmt::format("{} {}: exists and is not a directory", origin, p.string()));
  fs::create_directories(p, ec);
  if (ec) throw RunDirError(fmt::format("{} {}: cannot create the {} ({})", origin, shown, noun, ec.message()));
}

// Opens `dir` and locks it exclusively for as long as the returned descriptor stays open (flock on
// the directory itself: the kernel drops it when the process dies). A directory another live run
// holds is refused: "another run is <busy> (it stays locked ...)". Errors name `shown` and `noun`.
int lock_directory(const std::string& dir, const std::string& origin, const std::string& shown, const char* noun,
                   const char* busy) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw RunDirError(fmt::format("{} {}: cannot open the {} ({})", origin, shown, noun, std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK)
      throw RunDirError(fmt::format("{} {}: another run is {} (it stays locked while that run lives); wait for it to end "
                                    "or choose another directory",
                                    origin, shown, busy));
    throw RunDirError(fmt::format("{} {}: cannot lock the {} ({})", origin, shown, noun, std::strerror(err)));
  }
  return fd;
}

// Removes `dir` and the parents up to `top` that a claim created, while they are empty.
void remove_created(const std::string& dir, const std::string& top) {
  std::error_code ec;
  for (fs::path q = fs::absolute(dir, ec).lexically_normal(); !q.empty(); q = q.parent_path()) {
    if (::rmdir(q.c_str()) != 0) break;  // not empty (or gone): stop
    if (q == fs::path(top) || q == q.parent_path()) break;
  }
}

bool is_empty_dir(const std::string& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::directory_iterator(dir, ec) == fs::directory_iterator();
}

// realpath, or the lexically normal absolute path when it does not resolve.
std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  if (::realpath(p.c_str(), buf)) return buf;
  std::error_code ec;
  const fs::path w = fs::weakly_canonical(fs::absolute(p, ec), ec);
  return ec ? fs::absolute(p, ec).lexically_normal().string() : w.lexically_normal().string();
}

}  // namespace

RunDirClaim::RunDirClaim(std::string dir, std::string created_top, std::string origin)
    : dir_(std::move(dir)), created_top_(std::move(created_top)), origin_(std::move(origin)) {}

RunDirClaim::RunDirClaim(RunDirClaim&& o) noexcept
    : dir_(std::move(o.dir_)), created_top_(std::move(o.created_top_)), origin_(std::move(o.origin_)), fd_(o.fd_) {
  o.fd_ = -1;
  o.created_top_.clear();
}

RunDirClaim::~RunDirClaim() {
  // A claim still empty (a run refused before it wrote anything) goes, with the parents it created.
  if (!created_top_.empty() && is_empty_dir(dir_)) remove_created(dir_, created_top_);
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

void RunDirClaim::lock() {
  fd_ = lock_directory(dir_, origin_, dir_, "run directory", "writing to this run directory");
  // Writable: a probe file, removed at once.
  const std::string probe = fmt::format("{}/.write-probe.tmp.{}", dir_, ::getpid());
  const int pfd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = errno;
  if (pfd < 0) throw RunDirError(fmt::format("{} {}: the run directory is not writable ({})", origin_, dir_, std::strerror(err)));
  ::close(pfd);
  ::unlink(probe.c_str());
}

RunDirClaim RunDirClaim::at(const std::string& dir, const std::string& origin) {
  std::string top = outermost_missing(dir);
  create_dirs(dir, origin, dir);
  RunDirClaim c(dir, top, origin);
  c.lock();
  return c;
}

RunDirClaim RunDirClaim::next_version(const std::string& root, const std::string& name) {
  const std::string origin = "trainer.default_root_dir:";
  const fs::path base = fs::path(root) / name;
  std::string top = outermost_missing(base);
  create_dirs(base, origin, (base / "version_0").string());
  int64_t next = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(base, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("version_", 0) != 0 || n.size() == 8 || n.find_first_not_of("0123456789", 8) != std::string::npos) continue;
    try {
      next = std::max<int64_t>(next, std::stoll(n.substr(8)) + 1);
    } catch (const std::exception&) {
    }
  }
  // mkdir without -p is the claim: EEXIST means another run took this number first.
  for (int attempt = 0; attempt < 100000; ++attempt, ++next) {
    const std::string dir = (base / fmt::format("version_{}", next)).string();
    if (::mkdir(dir.c_str(), 0777) == 0) {
      RunDirClaim c(dir, top.empty() ? dir : top, origin);
      c.lock();
      return c;
    }
    if (errno != EEXIST)
      throw RunDirError(fmt::format("{} {}: cannot create the run directory ({})", origin, dir, std::strerror(errno)));
  }
  throw RunDirError(fmt::format("{} {}: no free version_<n> directory", origin, base.string()));
}

std::vector<std::string> RunDirClaim::run_files() const {
  std::vector<std::string> out;
  std::error_code ec;
  for (const char* f : {"config.yaml", "metrics.csv"})
    if (fs::exists(fs::path(dir_) / f, ec)) out.push_back(f);
  for (const auto& e : fs::directory_iterator(fs::path(dir_) / "checkpoints", ec))
    if (e.path().extension() == ".ckpt") out.push_back("checkpoints/" + e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

void RunDirClaim::remove_run_files() const {
  std::error_code ec;
  const fs::path d(dir_);
  for (const char* f : {"config.yaml", "metrics.csv", "model_summary.txt"}) fs::remove(d / f, ec);
  for (const auto& e : fs::directory_iterator(d, ec))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) fs::remove(e.path(), ec);
  std::vector<fs::path> ckpts;
  for (const auto& e : fs::directory_iterator(d / "checkpoints", ec))
    if (e.path().extension() == ".ckpt") ckpts.push_back(e.path());
  for (const auto& p : ckpts) fs::remove(p, ec);
  ::rmdir((d / "checkpoints").c_str());
  std::vector<fs::path> captures;
  for (const auto& e : fs::directory_iterator(d / "nan", ec))
    if (e.is_directory() && e.path().filename().string().rfind("step_", 0) == 0) captures.push_back(e.path());
  for (const auto& p : captures) checkpoint::remove_tree(p.string());
  ::rmdir((d / "nan").c_str());
}

namespace {

// A run directory: its config.yaml with its metrics.csv or with checkpoints in checkpoints/ (not a
// claimed checkpoint directory of that name, which holds an owner file). A project directory that
// holds the user's config.yaml is none.
bool is_run_directory(const fs::path& d) {
  std::error_code ec;
  if (!fs::exists(d / "config.yaml", ec)) return false;
  if (fs::exists(d / "metrics.csv", ec)) return true;
  if (fs::exists(d / "checkpoints" / CheckpointDirClaim::kOwnerFile, ec)) return false;
  for (const auto& e : fs::directory_iterator(d / "checkpoints", ec))
    if (e.path().extension() == ".ckpt") return true;
  return false;
}

// Locked by a live run (its run directory or checkpoint directory): a shared lock is refused.
bool locked_by_live_run(const fs::path& d) {
  const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool locked = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);  // drops the probe's lock
  return locked;
}

// The run directory a checkpoint directory's owner file names; nullopt when it has none.
std::optional<std::string> read_owner(const fs::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct stat st {};
  std::string text;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= 8192) {
    text.resize(static_cast<size_t>(st.st_size));
    const ssize_t n = ::read(fd, text.data(), text.size());
    text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  }
  ::close(fd);
  const std::string key = "run_dir=";
  if (text.rfind(key, 0) != 0) return std::string("an unknown run");
  const size_t end = text.find('\n');
  return text.substr(key.size(), end == std::string::npos ? std::string::npos : end - key.size());
}

bool lies_inside(const std::string& path, const std::string& dir) {
  return path == dir || path.rfind(dir == "/" ? dir : dir + "/", 0) == 0;
}

}  // namespace

std::unique_ptr<CheckpointDirClaim> CheckpointDirClaim::claim(const std::string& dir, const std::string& run_dir,
                                                              const std::string& origin,
                                                              const std::optional<std::string>& ckpt, bool overwrite) {
  const std::string run = real_path(run_dir);
  const std::string real = real_path(dir);
  if (lies_inside(real, run)) return nullptr;
  // Another run's directory, or a directory inside one (its checkpoints/): never ours to write.
  std::error_code ec;
  for (fs::path q = fs::path(real); !q.empty(); q = q.parent_path()) {
    if (fs::is_directory(q, ec)) {
      if (is_run_directory(q))
        throw RunDirError(fmt::format("{} {}: lies in the run directory {} of another run; give the checkpoints a "
                                      "directory of their own",
                                      origin, dir, q.string()));
      if (q.string() != real && locked_by_live_run(q))
        throw RunDirError(fmt::format("{} {}: lies in {}, which a live run is writing to; give the checkpoints a "
                                      "directory of their own",
                                      origin, dir, q.string()));
    }
    if (q == q.parent_path()) break;
  }
  const std::string top = outermost_missing(real);
  create_dirs(dir, origin, dir, "checkpoint directory");
  std::unique_ptr<CheckpointDirClaim> c(new CheckpointDirClaim(real, top));
  c->fd_ = lock_directory(real, origin, dir, "checkpoint directory", "writing checkpoints to this directory");
  const fs::path owner_file = fs::path(real) / kOwnerFile;
  const auto owner = read_owner(owner_file);
  std::vector<fs::path> ckpts;
  for (const auto& e : fs::directory_iterator(real, ec))
    if (e.path().extension() == ".ckpt") ckpts.push_back(e.path());
  std::sort(ckpts.begin(), ckpts.end());
  // Resuming: from a checkpoint of this directory (the run takes the series over), or this run
  // directory's own run from anywhere.
  const bool resuming = ckpt && (lies_inside(real_path(*ckpt), real) || (owner && *owner == run));
  if (!ckpts.empty() && !resuming) {
    if (!overwrite) {
      std::string list;
      for (size_t i = 0; i < ckpts.size() && i < 3; ++i) list += (i ? ", " : "") + ckpts[i].filename().string();
      if (ckpts.size() > 3) list += fmt::format(" and {} more", ckpts.size() - 3);
      const std::string whose = owner ? (*owner == run ? "an earlier run in " + run : "the run " + *owner) : "another run";
      throw RunDirError(fmt::format("{} {}: holds the checkpoints of {} ({}); to continue it pass --ckpt {}/last.ckpt, to "
                                    "start over in it pass --overwrite, or choose another directory",
                                    origin, dir, whose, list, dir));
    }
    for (const auto& p : ckpts) fs::remove(p, ec);
  }
  try {
    checkpoint::write_file_atomic(owner_file.string(), "run_dir=" + run + "\n");
  } catch (const checkpoint::CheckpointError& e) {
    throw RunDirError(fmt::format("{} {}: the checkpoint directory is not writable ({})", origin, dir, e.what()));
  }
  return c;
}

CheckpointDirClaim::~CheckpointDirClaim() {
  // A directory this claim created that holds nothing but its owner file goes, with the parents it created.
  if (!created_top_.empty()) {
    std::error_code ec;
    size_t others = 0;
    for (const auto& e : fs::directory_iterator(dir_, ec))
      if (e.path().filename() != kOwnerFile) ++others;
    if (!ec && others == 0) {
      fs::remove(fs::path(dir_) / kOwnerFile, ec);
      remove_created(dir_, created_top_);
    }
  }
  if (fd_ >= 0) ::close(fd_);
}

void check_run_dir_free(const RunDirClaim& claim, const std::string& origin, const std::optional<std::string>& ckpt,
                        bool overwrite) {
  const auto files = claim.run_files();
  if (files.empty()) return;
  if (ckpt) {
    // Resuming the run that lives here: its checkpoint lies inside it.
    const std::string dir = real_path(claim.dir()) + "/";
    if (real_path(*ckpt).rfind(dir, 0) == 0) return;
  }
  if (overwrite) {
    claim.remove_run_files();
    return;
  }
  std::string list;
  for (size_t i = 0; i < files.size() && i < 3; ++i) list += (i ? ", " : "") + files[i];
  if (files.size() > 3) list += fmt::format(" and {} more", files.size() - 3);
  throw RunDirError(fmt::format("{} {}: already holds a run ({}); to continue it pass --ckpt {}/checkpoints/last.ckpt, to "
                                "start over in it pass --overwrite, or choose another directory",
                                origin, claim.dir(), list, claim.dir()));
}

}  // namespace strobe
