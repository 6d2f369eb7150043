// Helpers for data tests: build a registered data module from YAML, make one batch without threads.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/datamodule.h"
#include "tests/test_dirs.h"

namespace strobe::testing {

inline std::shared_ptr<DataModule> build_data(const std::string& yaml, uint64_t seed = 7) {
  auto doc = config::Document::load_string(yaml, "test.yaml");
  auto section = doc.root();
  DataContext ctx;
  ctx.seed = seed;
  return data_registry().create(section, "", ctx);
}

// A fresh empty directory under the system temp dir, removed when the test process ends.
inline std::filesystem::path temp_dir(const std::string& name) {
  return empty_test_dir("strobe_data_test_" + name + "_" + std::to_string(::getpid()));
}

// The message of what f throws; "no error" when it throws nothing.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace strobe::testing
