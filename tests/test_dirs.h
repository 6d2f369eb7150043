#pragma once
// The folders tests write runs into. Each is new (mkdtemp) or emptied first, and every one a test
// process made is removed when that process ends, unless a test in it failed (the files are kept to
// look at) or STROBE_KEEP_TEST_DIRS is set. Without this, every suite run left gigabytes behind.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "strobe/checkpoint/checkpoint_io.h"

namespace strobe::testing {

class TestDirs {
 public:
  static TestDirs& instance() {
    static TestDirs dirs;
    return dirs;
  }
  void remove_at_exit(const std::string& dir) {
    std::lock_guard<std::mutex> lock(mutex_);
    dirs_.push_back(dir);
  }
  ~TestDirs() {
    // A forked child (death tests, rank processes) exits through here too: only the maker removes.
    if (::getpid() != owner_ || std::getenv("STROBE_KEEP_TEST_DIRS")) return;
    if (::testing::UnitTest::GetInstance()->Failed()) return;
    for (const auto& d : dirs_) checkpoint::remove_tree(d);  // never std::filesystem::remove_all (see there)
  }

 private:
  // gtest's singleton is made first, so it is destroyed after this and Failed() can still be read.
  TestDirs() { (void)::testing::UnitTest::GetInstance(); }
  pid_t owner_ = ::getpid();
  std::mutex mutex_;
  std::vector<std::string> dirs_;
};

// A new, empty folder <temp>/<group>/<tag>-XXXXXX, unique per call.
inline std::filesystem::path new_test_dir(const std::string& group, const std::string& tag) {
  auto base = std::filesystem::temp_directory_path() / group;
  std::filesystem::create_directories(base);
  std::string tmpl = (base / (tag + "-XXXXXX")).string();  // mkdtemp fills in the six X
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp " + tmpl + ": " + std::strerror(errno));
  std::string dir(buf.data());
  TestDirs::instance().remove_at_exit(dir);
  return dir;
}

// The empty folder <temp>/<name>: what it held before is removed first.
inline std::filesystem::path empty_test_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / name;
  checkpoint::remove_tree(dir.string());
  std::filesystem::create_directories(dir);
  TestDirs::instance().remove_at_exit(dir.string());
  return dir;
}

}  // namespace strobe::testing
