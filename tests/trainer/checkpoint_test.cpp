// Checkpoint files: atomic writes, refusal of truncated/corrupted files, and a crash mid-write that
// leaves the previous checkpoint intact.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/resume_compat.h"
#include "tests/cli/cli_test_util.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {
checkpoint::CheckpointData sample_data(float v) {
  checkpoint::CheckpointData d;
  d.tensors["model/w"] = torch::full({64, 64}, v);
  d.tensors["rng/cpu"] = torch::arange(10, torch::kUInt8);
  d.blobs["config"] = "name: x\n";
  d.blobs["loop"] = std::string("\0\1\2binary", 9);
  return d;
}

std::string refusal(const std::string& path) {
  try {
    checkpoint::load_checkpoint_file(path);
  } catch (const checkpoint::CheckpointError& e) {
    return e.what();
  }
  return "";
}

std::string read_all(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_all(const std::string& p, const std::string& s) { std::ofstream(p, std::ios::binary | std::ios::trunc) << s; }
}  // namespace

TEST(Checkpoint, RoundTripsTensorsAndBlobs) {
  std::string p = temp_dir("ckpt") + "/a.ckpt";
  checkpoint::save_checkpoint_file(p, sample_data(1.5f));
  auto d = checkpoint::load_checkpoint_file(p);
  EXPECT_TRUE(torch::equal(d.tensor("model/w"), torch::full({64, 64}, 1.5f)));
  EXPECT_TRUE(torch::equal(d.tensor("rng/cpu"), torch::arange(10, torch::kUInt8)));
  EXPECT_EQ(d.blob("loop"), std::string("\0\1\2binary", 9));
  EXPECT_EQ(d.blob("config"), "name: x\n");
}

TEST(Checkpoint, CrashDuringWriteLeavesThePreviousCheckpointLoadable) {
  std::string dir = temp_dir("ckpt-crash");
  std::string p = dir + "/last.ckpt";
  checkpoint::save_checkpoint_file(p, sample_data(1.0f));
  std::string before = read_all(p);
  checkpoint::set_write_observer_for_testing([](size_t written) {
    if (written > 1000) throw std::runtime_error("simulated crash");
  });
  EXPECT_THROW(checkpoint::save_checkpoint_file(p, sample_data(2.0f)), std::runtime_error);
  checkpoint::set_write_observer_for_testing(nullptr);
  EXPECT_EQ(read_all(p), before);
  auto d = checkpoint::load_checkpoint_file(p);
  EXPECT_TRUE(torch::equal(d.tensor("model/w"), torch::full({64, 64}, 1.0f)));
  // A process killed mid-write leaves at most a temp file, which nothing reads.
  write_all(dir + "/.last.ckpt.tmp.12345", before.substr(0, 100));
  EXPECT_NO_THROW(checkpoint::load_checkpoint_file(p));
}

TEST(Checkpoint, TruncatedFileIsRefused) {
  std::string p = temp_dir("ckpt-trunc") + "/a.ckpt";
  checkpoint::save_checkpoint_file(p, sample_data(1.0f));
  std::string s = read_all(p);
  write_all(p, s.substr(0, s.size() / 2));
  EXPECT_NE(refusal(p).find("truncated or damaged checkpoint"), std::string::npos) << refusal(p);
  write_all(p, s.substr(0, 10));
  EXPECT_NE(refusal(p).find("not a Strobe checkpoint"), std::string::npos) << refusal(p);
}

TEST(Checkpoint, CorruptedByteIsRefused) {
  std::string p = temp_dir("ckpt-corrupt") + "/a.ckpt";
  checkpoint::save_checkpoint_file(p, sample_data(1.0f));
  std::string s = read_all(p);
  s[s.size() / 2] ^= 0x5a;
  write_all(p, s);
  EXPECT_EQ(refusal(p), p + ": corrupted checkpoint (checksum mismatch)");
}

TEST(Checkpoint, OtherFilesAndMissingFilesAreRefused) {
  std::string dir = temp_dir("ckpt-other");
  write_all(dir + "/x.ckpt", "name: not a checkpoint\n");
  EXPECT_NE(refusal(dir + "/x.ckpt").find("bad magic"), std::string::npos);
  EXPECT_NE(refusal(dir + "/missing.ckpt").find("cannot open checkpoint"), std::string::npos);
}

TEST(Checkpoint, TrainerRefusesCheckpointOfAnotherModel) {
  std::string dir = temp_dir("ckpt-model");
  auto run = make_run(tiny_yaml(), {"trainer.max_steps=2"}, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  auto other = make_run(tiny_yaml(), {"model.hidden=[8]"}, temp_dir("ckpt-model2"));
  try {
    other->trainer->fit(checkpoint::load_checkpoint_file(dir + "/checkpoints/last.ckpt"));
    FAIL() << "loaded a checkpoint of another model";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("shape"), std::string::npos) << e.what();
  }
}

// Strict weights, named when no config tells the difference: the first missing, unexpected and
// mis-shaped tensors, each with how many more; no difference at all is "".
TEST(Checkpoint, WeightsMismatchNamesTheTensorsWhenNoConfigKeyExplainsIt) {
  torch::nn::Sequential net(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
  checkpoint::CheckpointData d;
  for (const auto& p : net->named_parameters()) d.tensors["model/" + p.key()] = p.value().detach().clone();
  d.tensors["optimizer/not_a_weight"] = torch::zeros({1});
  EXPECT_EQ(weights_mismatch(d, compare_configs(d, ""), *net), "");
  d.tensors.erase("model/1.bias");
  d.tensors["model/2.weight"] = torch::zeros({2, 2});
  d.tensors["model/2.bias"] = torch::zeros({2});
  d.tensors["model/0.weight"] = torch::zeros({5, 4});
  EXPECT_EQ(weights_mismatch(d, compare_configs(d, ""), *net),
            "missing '1.bias'; unexpected '2.bias' (and 1 more); '0.weight' is [5, 4] in the checkpoint, [3, 4] in the model");
  // A saved config whose model keys differ from the current one: those keys first.
  d.blobs["config"] = "model:\n  name: mlp\n  hidden: [5]\n";
  const ConfigComparison configs = compare_configs(d, "model:\n  name: mlp\n  hidden: [3]\n");
  EXPECT_EQ(weights_mismatch(d, configs, *net).rfind("model.hidden: checkpoint [5], config [3] (missing '1.bias';", 0), 0u)
      << weights_mismatch(d, configs, *net);
  // The config a command parsed already is used when it is the checkpoint's (and only then).
  auto parsed = std::make_shared<const config::SavedConfig>(d.blob("config"), "read before");
  EXPECT_EQ(compare_configs(d, "model:\n  name: mlp\n  hidden: [3]\n", parsed).saved, parsed);
  auto other = std::make_shared<const config::SavedConfig>("model:\n  name: mlp\n  hidden: [9]\n", "another");
  const ConfigComparison fresh = compare_configs(d, "model:\n  name: mlp\n  hidden: [3]\n", other);
  ASSERT_NE(fresh.saved, nullptr);
  EXPECT_NE(fresh.saved, other);
  EXPECT_EQ(weights_mismatch(d, fresh, *net).rfind("model.hidden: checkpoint [5], config [3]", 0), 0u);
  // A saved config that does not parse: the tensors alone are named, and a resume is refused naming it.
  d.blobs["config"] = "model: [unclosed\n";
  const ConfigComparison broken = compare_configs(d, "model:\n  name: mlp\n");
  EXPECT_EQ(broken.saved, nullptr);
  EXPECT_EQ(weights_mismatch(d, broken, *net).rfind("missing '1.bias'", 0), 0u);
  EXPECT_NE(broken.error.find("the checkpoint's config:"), std::string::npos) << broken.error;
}

// What a stop signal's handler calls before the process exits: the temporaries being written now are
// unlinked (the target keeps its previous content), and one already renamed into place is not touched.
TEST(Checkpoint, PendingTemporariesAreUnlinkedForAStopSignal) {
  const std::string dir = temp_dir("pending-temps");
  checkpoint::write_file_atomic(dir + "/a.txt", "before");
  const std::string bytes = "after";
  checkpoint::PendingWrite pending(dir + "/a.txt", {{bytes.data(), bytes.size()}});
  const std::string tmp = dir + "/.a.txt.tmp." + std::to_string(::getpid());
  ASSERT_TRUE(std::filesystem::exists(tmp));
  checkpoint::write_file_atomic(dir + "/b.txt", "whole");
  checkpoint::unlink_pending_temp_files();
  EXPECT_FALSE(std::filesystem::exists(tmp));
  EXPECT_EQ(slurp(dir + "/a.txt"), "before");
  EXPECT_EQ(slurp(dir + "/b.txt"), "whole");
}
