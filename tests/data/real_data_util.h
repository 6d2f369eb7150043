// Helpers for the real-data tests: the strobe CLI and the data tool, fixtures under a fresh temp dir,
// metrics.csv and checkpoint readers.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "tests/data/data_test_util.h"
#include "tests/test_dirs.h"

namespace strobe::testing {

// A new, empty folder, removed when the test process ends (tests/test_dirs.h).
inline std::filesystem::path fresh_dir(const std::string& tag) { return new_test_dir("strobe-data-tests", tag); }

inline std::string strobe_bin() {
  const char* b = std::getenv("STROBE_BIN");
  return b ? b : "bin/strobe";
}
inline std::string data_tool_bin() { return (std::filesystem::path(strobe_bin()).parent_path() / "strobe_data_tool").string(); }

inline std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct CmdResult {
  int code;
  std::string out, err;
};

inline CmdResult run_cmd(const std::string& cmd) {
  auto dir = fresh_dir("cmd");
  int rc = std::system((cmd + " > " + (dir / "out").string() + " 2> " + (dir / "err").string()).c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp((dir / "out").string()), slurp((dir / "err").string())};
}

inline bool have_fashion_mnist() { return std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"); }

// An image folder of real JPEGs and PNGs made from Fashion-MNIST by strobe_data_tool.
inline std::filesystem::path fashion_folder(const std::string& name, int per_class) {
  auto dir = fresh_dir(name) / "images";
  auto r = run_cmd(data_tool_bin() + " fashion-folder " + dir.string() + " " + std::to_string(per_class));
  EXPECT_EQ(r.code, 0) << r.err;
  return dir;
}

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// metrics.csv: step -> value of `column` (text, so equality is bitwise on what was logged).
inline std::map<int64_t, std::string> csv_column(const std::string& path, const std::string& column) {
  std::ifstream in(path);
  std::string header;
  std::getline(in, header);
  std::vector<std::string> cols;
  std::stringstream hs(header);
  for (std::string c; std::getline(hs, c, ',');) cols.push_back(c);
  std::map<int64_t, std::string> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::stringstream ls(line + ",");
    for (std::string c; std::getline(ls, c, ',');) cells.push_back(c);
    for (size_t i = 1; i < cells.size() && i < cols.size(); ++i)
      if (cols[i] == column && !cells[i].empty()) rows[std::stoll(cells[0])] = cells[i];
  }
  return rows;
}

inline std::map<std::string, torch::Tensor> model_tensors_of(const std::string& ckpt) {
  auto d = checkpoint::load_checkpoint_file(ckpt);
  std::map<std::string, torch::Tensor> out;
  for (auto& kv : d.tensors)
    if (kv.first.rfind("model/", 0) == 0) out[kv.first] = kv.second;
  return out;
}

}  // namespace strobe::testing
