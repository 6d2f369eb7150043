#include "tests/distributed/write_watch.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>

namespace {

std::mutex& watch_mutex() {
  static std::mutex m;
  return m;
}
std::string& watch_prefix() {
  static std::string p;
  return p;
}
std::vector<std::string>& watch_log() {
  static std::vector<std::string> v;
  return v;
}

void note(const char* path) {
  if (!path) return;
  std::lock_guard<std::mutex> lock(watch_mutex());
  const std::string& prefix = watch_prefix();
  if (prefix.empty() || std::strncmp(path, prefix.c_str(), prefix.size()) != 0) return;
  watch_log().emplace_back(path);
}

bool writes(int flags) { return (flags & (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND)) != 0; }
bool writes(const char* mode) { return mode && (std::strchr(mode, 'w') || std::strchr(mode, 'a') || std::strchr(mode, '+')); }

template <class F>
F real(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

}  // namespace

namespace strobe::testing {

void watch_writes_under(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(watch_mutex());
  watch_prefix() = prefix;
  watch_log().clear();
}

std::vector<std::string> watched_writes() {
  std::lock_guard<std::mutex> lock(watch_mutex());
  return watch_log();
}

}  // namespace strobe::testing

extern "C" {

int open(const char* path, int flags, ...) {
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) {
    va_list ap;
    va_start(ap, flags);
    mode = static_cast<mode_t>(va_arg(ap, int));
    va_end(ap);
  }
  if (writes(flags)) note(path);
  return static_cast<int>(syscall(SYS_openat, AT_FDCWD, path, flags, mode));
}

int open64(const char* path, int flags, ...) {
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) {
    va_list ap;
    va_start(ap, flags);
    mode = static_cast<mode_t>(va_arg(ap, int));
    va_end(ap);
  }
  if (writes(flags)) note(path);
  return static_cast<int>(syscall(SYS_openat, AT_FDCWD, path, flags, mode));
}

int openat(int dirfd, const char* path, int flags, ...) {
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) {
    va_list ap;
    va_start(ap, flags);
    mode = static_cast<mode_t>(va_arg(ap, int));
    va_end(ap);
  }
  if (writes(flags)) note(path);
  return static_cast<int>(syscall(SYS_openat, dirfd, path, flags, mode));
}

FILE* fopen(const char* path, const char* mode) {
  if (writes(mode)) note(path);
  static auto f = real<FILE* (*)(const char*, const char*)>("fopen");
  return f(path, mode);
}

FILE* fopen64(const char* path, const char* mode) {
  if (writes(mode)) note(path);
  static auto f = real<FILE* (*)(const char*, const char*)>("fopen64");
  return f(path, mode);
}

int rename(const char* from, const char* to) {
  note(to);
  return static_cast<int>(syscall(SYS_renameat, AT_FDCWD, from, AT_FDCWD, to));
}

int mkdir(const char* path, mode_t mode) {
  note(path);
  return static_cast<int>(syscall(SYS_mkdirat, AT_FDCWD, path, mode));
}

}  // extern "C"
