#include "strobe/checkpoint/output_guard.h"
#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/json_text.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace strobe::checkpoint {
namespace {

namespace fs = std::filesystem;

// The absolute path with the links of its existing part resolved.
fs::path normal(const std::string& p) {
  std::error_code ec;
  const fs::path abs = fs::absolute(p, ec);
  if (ec) return fs::path(p).lexically_normal();
  const fs::path w = fs::weakly_canonical(abs, ec);
  return ec ? abs.lexically_normal() : w;
}

// Whether `p` lies below `dir` (both normal()).
bool below(const fs::path& p, const fs::path& dir) {
  auto i = p.begin();
  for (auto d = dir.begin(); d != dir.end(); ++d, ++i) {
    if (d->empty()) continue;  // a trailing separator
    if (i == p.end() || *i != *d) return false;
  }
  return i != p.end();
}

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Creates and removes, in the output's folder, the temporary the atomic writers create there
// (".<name>.tmp.<pid>", checkpoint_io.h): what fails now would fail after the work.
void probe_folder(const std::string& option, const std::string& shown, const fs::path& target) {
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    throw OutputRefused(err == ENOENT ? fmt::format("{} {}: the directory {} does not exist", option, shown, dir.string())
                                      : fmt::format("{} {}: cannot reach the directory {} ({})", option, shown, dir.string(),
                                                    std::strerror(err)));
  }
  if (!S_ISDIR(st.st_mode)) throw OutputRefused(fmt::format("{} {}: {} is not a directory", option, shown, dir.string()));
  const fs::path tmp = dir / fmt::format(".{}.tmp.{}", target.filename().string(), ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == EEXIST) return;  // a leftover of this pid's name: the folder takes files
    if (err == ENAMETOOLONG)
      throw OutputRefused(fmt::format("{} {}: the name is too long for the file system; give a shorter one", option, shown));
    throw OutputRefused(fmt::format("{} {}: cannot write in {} ({})", option, shown, dir.string(), std::strerror(err)));
  }
  ::close(fd);
  ::unlink(tmp.c_str());
}

}  // namespace

bool same_path(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec);
  return normal(a) == normal(b);
}

void check_output_file(const OutputFile& o) {
  auto refuse = [&](const std::string& why) { throw OutputRefused(fmt::format("{} {}: {}", o.option, o.path, why)); };
  if (fs::path(o.path).filename().empty() || fs::path(o.path).filename() == "." || fs::path(o.path).filename() == "..")
    refuse("names a directory; give a file name");
  for (const auto& other : o.other_outputs)
    if (!other.path.empty() && same_path(o.path, other.path)) refuse(fmt::format("is also {}; give each output its own file", other.what));
  struct stat st {};
  if (::stat(o.path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) refuse("is a directory");
    if (!S_ISREG(st.st_mode)) refuse("exists and is not a regular file (a FIFO, a socket or a device); give a file name");
    const fs::path out = normal(o.path);
    for (const auto& in : o.inputs) {
      if (in.path.empty()) continue;
      if (same_path(o.path, in.path))
        refuse(fmt::format("is {}, an input of this command; it is never replaced, --overwrite or not: write elsewhere", in.what));
      if (is_dir(in.path) && below(out, normal(in.path)))
        refuse(fmt::format("lies in {} ({}), which this command reads; it is never replaced, --overwrite or not: write elsewhere",
                           in.what, in.path));
    }
    if (!o.overwrite && !(o.is_own && o.is_own(o.path)))
      refuse(o.own_kind.empty() ? "exists (pass --overwrite to replace it)"
                                : fmt::format("exists and is not {} (pass --overwrite to replace it)", o.own_kind));
  }
  probe_folder(o.option, o.path, fs::path(o.path));
}

void check_output_directory(const std::string& option, const std::string& dir, bool overwrite,
                            const std::vector<CommandInput>& inputs) {
  auto refuse = [&](const std::string& why) { throw OutputRefused(fmt::format("{} {}: {}", option, dir, why)); };
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) refuse("exists and is not a directory");
    const fs::path out = normal(dir);
    for (const auto& in : inputs) {
      if (in.path.empty()) continue;
      if (same_path(dir, in.path)) refuse(fmt::format("is {}, an input of this command: write elsewhere", in.what));
      if (below(normal(in.path), out))
        refuse(fmt::format("holds {} ({}); write to a directory of its own", in.what, in.path));
      if (is_dir(in.path) && below(out, normal(in.path)))
        refuse(fmt::format("lies in {} ({}), which this command reads: write elsewhere", in.what, in.path));
    }
    std::error_code ec;
    for (const char* run_file : {"config.yaml", "metrics.csv", "checkpoints", ".strobe-owner"})
      if (fs::exists(out / run_file, ec)) refuse(fmt::format("is a run directory (it holds {}); write to a directory of its own", run_file));
    bool holds_files = false;
    for (const auto& e : fs::directory_iterator(out, ec)) {
      if (e.path().extension() == ".ckpt")
        refuse(fmt::format("holds Strobe checkpoints ({}); write to a directory of its own", e.path().filename().string()));
      holds_files = true;
    }
    if (holds_files && !overwrite) refuse("the directory holds files (pass --overwrite to replace the ones this command writes)");
    probe_folder(option, dir, fs::path(dir) / "model.safetensors");
    return;
  }
  // A new directory (its writer creates it): the outermost missing part must be creatable.
  fs::path missing = fs::absolute(dir).lexically_normal();
  if (missing.filename().empty()) missing = missing.parent_path();
  std::error_code ec;
  while (missing.has_parent_path() && missing.parent_path() != missing && !fs::exists(missing.parent_path(), ec))
    missing = missing.parent_path();
  probe_folder(option, dir, missing);
}

void write_output(const std::string& option, const std::string& path, const std::function<void()>& write) {
  try {
    write();
  } catch (const CheckpointError& e) {
    throw WriteError(fmt::format("{} {}: cannot write it: {}", option, path, e.what()));
  }
}

bool json_file_where(const std::string& path, const std::function<bool(const nlohmann::json&)>& accept, size_t max_bytes) {
  const JsonFile f = read_json_file(path, max_bytes);
  if (f.problem != JsonFile::Problem::kNone || !f.json.is_object()) return false;
  try {
    return accept(f.json);
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

}  // namespace strobe::checkpoint
