// strobe tune batch-size on a GPU capped at 2 GiB (bench's --memory-limit-gib: a smaller GPU's
// answer on a larger one): a decoder LM whose activations grow with the batch. binsearch's answer B
// validates and trains under the cap by hand (`strobe bench step` with the same cap and the trial's 2
// validation batches first: exit 0) and B + 1 does not (out of memory), and --apply writes the
// config with it. The validation batches count: the caching allocator keeps their blocks, and on
// this LM B + 1 trains when nothing validated first (measured on an H200). docs/CONFIG.md
// "strobe tune batch-size".
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <regex>

#include "tests/gpu_trainer/cuda_skip.h"
#include "tests/trainer/trainer_test_util.h"

namespace {

std::pair<int, std::string> sh(const std::string& cmd, const std::string& log) {
  const int raw = std::system((cmd + " > " + log + " 2>&1").c_str());
  std::ifstream in(log);
  std::string out((std::istreambuf_iterator<char>(in)), {});
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, out};
}

}  // namespace

TEST(BatchSizeFinderCuda, TheAnswerTrainsUnderTheCapAndOneMoreDoesNot) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const char* bin = std::getenv("STROBE_BIN");
  ASSERT_TRUE(bin != nullptr) << "STROBE_BIN must name the strobe executable (set by ctest)";
  const std::string dir = strobe::testing::temp_dir("batch-size-finder");
  std::ofstream(dir + "/lm.yaml") << R"(name: finder
seed: 1
trainer: {max_steps: 2, precision: bf16-mixed, device: auto}
model: {name: decoder_lm, vocab_size: 8192, max_seq_len: 512, embed_dim: 256, depth: 2, num_heads: 4}
data: {name: synthetic_tokens, vocab_size: 8192, max_seq_len: 512, num_samples: 4096, num_val_samples: 64, collate: pad_to_max, batch_size: 4, num_workers: 2}
optimizer: {name: adamw, lr: 0.001}
)";
  const std::string cap = " --memory-limit-gib 2";
  auto [rc, out] = sh(std::string(bin) + " tune batch-size -c " + dir + "/lm.yaml --mode binsearch --steps 2 --apply " + dir +
                          "/tuned.yaml" + cap,
                      dir + "/finder.log");
  ASSERT_EQ(rc, 0) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("largest batch that trains: (\\d+) \\((\\d+) runs out of memory"))) << out;
  const int b = std::stoi(m[1]), bad = std::stoi(m[2]);
  EXPECT_EQ(bad, b + 1) << out;
  EXPECT_GT(b, 4) << out;
  std::ifstream tuned(dir + "/tuned.yaml");
  const std::string text((std::istreambuf_iterator<char>(tuned)), {});
  EXPECT_NE(text.find("batch_size: " + std::to_string(b)), std::string::npos) << text;
  // By hand, as a run begins (2 sanity validation batches, then training): the answer fits under the
  // same cap, one more sample does not.
  auto step = [&](int batch) {
    return sh(std::string(bin) + " bench step -c " + dir + "/lm.yaml --set data.batch_size=" + std::to_string(batch) +
                  " --set trainer.memory_check=false --set trainer.num_sanity_val_steps=2 --set trainer.limit_val_batches=2"
                  " --warmup 1 --steps 2" + cap,
              dir + "/step" + std::to_string(batch) + ".log");
  };
  auto [ok_rc, ok_out] = step(b);
  EXPECT_EQ(ok_rc, 0) << ok_out;
  auto [no_rc, no_out] = step(b + 1);
  EXPECT_EQ(no_rc, 1) << no_out;
  EXPECT_NE(no_out.find("out of memory"), std::string::npos) << no_out;
}
