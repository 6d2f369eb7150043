// The quarantine file's writer (strobe replay --bisect --write-quarantine) under concurrency: writers
// adding to one file at once each keep their samples (an exclusive lock around the read-add-write).
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "runner/replay.h"
#include "strobe/core/quarantine.h"
#include "tests/trainer/trainer_test_util.h"

namespace strobe {
namespace {

TEST(Quarantine, WritersAtOnceEachKeepTheirSamples) {
  const std::string path = testing::temp_dir("quarantine-lock") + "/q.json";
  std::vector<std::thread> writers;
  for (int w = 0; w < 8; ++w)
    writers.emplace_back([&path, w] {
      for (int i = 0; i < 10; ++i)
        capture::write_quarantine(path, nlohmann::json::array({{{"split", "train"}, {"dataset_index", 100 * w + i}}}), "cap");
    });
  for (auto& t : writers) t.join();
  const Quarantine q = read_quarantine(path);
  ASSERT_EQ(q.indices.at("train").size(), 80u) << q.json.dump();
  std::vector<int64_t> got = q.indices.at("train");
  std::sort(got.begin(), got.end());
  for (int w = 0; w < 8; ++w)
    for (int i = 0; i < 10; ++i) EXPECT_TRUE(std::binary_search(got.begin(), got.end(), 100 * w + i)) << 100 * w + i;
}

}  // namespace
}  // namespace strobe
