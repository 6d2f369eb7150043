// Loading a checkpoint holds the loaded tensors and no copy of the file (docs/ARCHITECTURE.md, the
// checkpoint floor). A child process gets a data limit (RLIMIT_DATA: the heap and private writable
// mappings; the read-only mapping of the file is not counted) with room for the tensors once and a
// half: a 256 MiB checkpoint loads under it. The control: under the same limit, the file read into
// memory and copied once (what a copying reader does, and the old one held about four copies) fails.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "tests/test_dirs.h"

namespace {

using strobe::checkpoint::CheckpointData;

constexpr int64_t kTensorBytes = int64_t{256} << 20;

int64_t vm_data_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmData:", 0) == 0) return std::stoll(line.substr(7)) * 1024;  // kB
  return -1;
}

// Runs `body` in a child process under a data limit of what it uses now + 1.5 x the tensor bytes +
// 64 MiB; returns the child's exit status (the body's, 98 for an exception, 99 without a limit).
int under_data_limit(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int64_t used = vm_data_bytes();
    rlimit r{};
    if (used < 0 || ::getrlimit(RLIMIT_DATA, &r) != 0) ::_exit(99);
    r.rlim_cur = static_cast<rlim_t>(used + kTensorBytes * 3 / 2 + (int64_t{64} << 20));
    if (::setrlimit(RLIMIT_DATA, &r) != 0) ::_exit(99);
    try {
      ::_exit(body());
    } catch (...) {
      ::_exit(98);
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(CheckpointMemory, ALoadHoldsTheTensorsAndNoCopyOfTheFile) {
  const std::string path = strobe::testing::new_test_dir("strobe-tests", "ckpt-memory").string() + "/big.ckpt";
  {
    // Filled by a plain loop (no intra-op threads before the fork).
    std::vector<float> values(kTensorBytes / sizeof(float));
    for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 1009);
    CheckpointData d;
    d.tensors["w"] = torch::from_blob(values.data(), {static_cast<int64_t>(values.size())}, torch::kFloat32);
    d.blobs["config"] = "name: big\n";
    strobe::checkpoint::save_checkpoint_file(path, d);
  }
  const int loaded = under_data_limit([&] {
    const auto d = strobe::checkpoint::load_checkpoint_file(path);
    const auto& w = d.tensors.at("w");
    return w.numel() * 4 == kTensorBytes && w[1009 * 7 + 5].item<float>() == 5.0f ? 0 : 3;
  });
  EXPECT_EQ(loaded, 0) << "the 256 MiB checkpoint did not load within 1.5x its tensors (98: out of memory)";
  const int copied = under_data_limit([&] {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    std::string file(static_cast<size_t>(in.tellg()), '\0');
    in.seekg(0);
    in.read(file.data(), static_cast<std::streamsize>(file.size()));
    const std::string copy = file;
    return copy.size() == file.size() ? 0 : 3;
  });
  EXPECT_EQ(copied, 98) << "the control: two copies of the file fit under the limit, so the limit proves nothing";
}

}  // namespace
