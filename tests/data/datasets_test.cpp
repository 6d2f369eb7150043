#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tests/data/data_test_util.h"

namespace strobe {
namespace {

using testing::build_data;
using testing::temp_dir;

using testing::error_of;

TEST(SyntheticBoxes, TargetsArePaddedAndValidRowsAreExactlyTheBoxes) {
  auto dm = build_data("{name: synthetic_boxes, image_size: 64, max_boxes: 256, num_samples: 256, batch_size: 256, num_workers: 0}");
  auto b = dm->train_loader()->make_batch(0, 0);
  ASSERT_EQ(b.at("image").sizes(), (torch::IntArrayRef{256, 1, 64, 64}));
  EXPECT_EQ(b.at("image").scalar_type(), torch::kUInt8);
  ASSERT_EQ(b.at("boxes").sizes(), (torch::IntArrayRef{256, 256, 4}));
  auto valid = b.at("boxes").select(-1, 3) > 0;
  EXPECT_TRUE(valid.sum(1).equal(b.at("num_boxes")));
  // Valid rows come first; boxes lie in the image with x1 <= x2, y1 < y2.
  auto n = b.at("num_boxes");
  EXPECT_TRUE(valid.equal(torch::arange(256).unsqueeze(0) < n.unsqueeze(1)));
  auto boxes = b.at("boxes");
  EXPECT_LE(boxes.max().item<float>(), 63.f);
  EXPECT_TRUE(((boxes.select(-1, 2) >= boxes.select(-1, 0)) | ~valid).all().item<bool>());
  // The seed's count distribution: floor(|N(0,3)|) — mean ~1.9, mostly <= 5.
  auto nf = n.to(torch::kFloat64);
  EXPECT_NEAR(nf.mean().item<double>(), 1.9, 0.45);
  EXPECT_GT((n <= 5).to(torch::kFloat64).mean().item<double>(), 0.85);
}

TEST(SyntheticBoxes, BoxesAreVisibleInTheImage) {
  auto dm = build_data("{name: synthetic_boxes, image_size: 64, num_samples: 64, batch_size: 64, num_workers: 0}");
  auto b = dm->train_loader()->make_batch(0, 0);
  auto boxes = b.at("boxes").to(torch::kLong);
  int checked = 0;
  for (int64_t i = 0; i < 64; ++i) {
    for (int64_t j = 0; j < b.at("num_boxes")[i].item<int64_t>(); ++j, ++checked) {
      auto x1 = boxes[i][j][0].item<int64_t>(), y1 = boxes[i][j][1].item<int64_t>();
      auto x2 = boxes[i][j][2].item<int64_t>(), y2 = boxes[i][j][3].item<int64_t>();
      for (auto [x, y] : {std::pair{x1, y1}, std::pair{x2, y2}, std::pair{x1, y2}, std::pair{x2, y1}})
        EXPECT_EQ(b.at("image")[i][0][y][x].item<uint8_t>(), 255);
    }
  }
  EXPECT_GT(checked, 20);
  // Background noise stays below the box intensity.
  EXPECT_LT(b.at("image").to(torch::kFloat32).mean().item<float>(), 128.f);
}

TEST(SyntheticBoxes, SamplesArePureFunctionsOfSeedAndValDiffersFromTrain) {
  const std::string cfg = "{name: synthetic_boxes, image_size: 32, num_samples: 16, num_val_samples: 16, batch_size: 8, num_workers: 0, shuffle: false}";
  auto a = build_data(cfg)->train_loader()->make_batch(0, 1);
  auto b = build_data(cfg)->train_loader()->make_batch(0, 1);
  EXPECT_TRUE(a.at("image").equal(b.at("image")));
  auto val = build_data(cfg)->val_loader()->make_batch(0, 1);
  EXPECT_FALSE(a.at("image").equal(val.at("image")));
}

TEST(SyntheticTokens, LengthsFollowTheSeedAndTargetsAreShiftedTokens) {
  auto dm = build_data("{name: synthetic_tokens, vocab_size: 40, max_seq_len: 12, num_samples: 64, batch_size: 64, num_workers: 0, collate: pack}");
  auto b = dm->train_loader()->make_batch(0, 0);
  auto lengths = b.at("lengths");
  EXPECT_GE(lengths.min().item<int64_t>(), 1);
  EXPECT_LE(lengths.max().item<int64_t>(), 11);
  EXPECT_GE(b.at("tokens").min().item<int64_t>(), 1);
  EXPECT_LT(b.at("tokens").max().item<int64_t>(), 40);
  // targets[t] == tokens[t + 1] inside each sequence.
  auto cu = b.at("cu_seqlens").to(torch::kLong);
  auto tok = b.at("tokens"), tgt = b.at("targets");
  for (int64_t i = 0; i < 64; ++i) {
    auto s = cu[i].item<int64_t>(), e = cu[i + 1].item<int64_t>();
    if (e - s > 1) EXPECT_TRUE(tgt.slice(0, s, e - 1).equal(tok.slice(0, s + 1, e)));
  }
  EXPECT_EQ(b.meta.at("max_seqlen"), lengths.max().item<int64_t>());
}

TEST(SyntheticTokens, FixedLengthGivesFullSequencesWithoutPadding) {
  auto dm = build_data("{name: synthetic_tokens, vocab_size: 40, max_seq_len: 12, fixed_length: true, num_samples: 16, "
                       "batch_size: 8, num_workers: 0, collate: pad_to_max}");
  auto b = dm->train_loader()->make_batch(0, 0);
  ASSERT_EQ(b.at("tokens").sizes(), (std::vector<int64_t>{8, 12}));
  EXPECT_GE(b.at("tokens").min().item<int64_t>(), 1) << "no pad token anywhere";
  EXPECT_GE(b.at("targets").min().item<int64_t>(), 1) << "no ignored target anywhere";
  EXPECT_TRUE(b.at("targets").narrow(1, 0, 11).equal(b.at("tokens").narrow(1, 1, 11)));
}

TEST(SyntheticTokens, CollateIsSelectableAndUnknownOnesAreConfigErrors) {
  for (const char* c : {"pad_to_max", "pad_to_longest", "pack"}) {
    auto dm = build_data(std::string("{name: synthetic_tokens, vocab_size: 40, max_seq_len: 12, num_samples: 8, batch_size: 4, num_workers: 0, collate: ") + c + "}");
    auto b = dm->train_loader()->make_batch(0, 0);
    EXPECT_EQ(b.at("tokens").dim(), std::string(c) == "pack" ? 1 : 2) << c;
  }
  EXPECT_THROW(build_data("{name: synthetic_tokens, collate: pad}"), config::ConfigError);
}

TEST(TextFile, CutsFortunesIntoByteSequences) {
  auto dir = temp_dir("text");
  std::ofstream(dir / "fortunes") << "Hello world\n%\nA\n%\nSecond fortune, a bit longer than max.\n";
  auto dm = build_data("{name: text_file, path: " + (dir / "fortunes").string() +
                       ", max_seq_len: 16, batch_size: 8, num_workers: 0, shuffle: false, val_fraction: 0.0, collate: pack}");
  auto b = dm->train_loader()->make_batch(0, 0);
  // "Hello world" (11 bytes) -> 10 tokens; "A" dropped; 39-byte fortune -> pieces of 17, 17, 5 bytes.
  EXPECT_TRUE(b.at("lengths").equal(torch::tensor({10, 16, 16, 4}, torch::kInt64)));
  EXPECT_EQ(b.at("tokens")[0].item<int64_t>(), 'H');
  EXPECT_EQ(b.at("targets")[0].item<int64_t>(), 'e');
}

TEST(TextFile, BadInputsNameTheFile) {
  auto dir = temp_dir("text_bad");
  std::ofstream(dir / "empty.txt").close();
  auto msg = error_of([&] { build_data("{name: text_file, path: " + (dir / "empty.txt").string() + "}"); });
  EXPECT_NE(msg.find((dir / "empty.txt").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("empty"), std::string::npos) << msg;
  msg = error_of([&] { build_data("{name: text_file, path: " + (dir / "missing.txt").string() + "}"); });
  EXPECT_NE(msg.find((dir / "missing.txt").string()), std::string::npos) << msg;
  std::filesystem::create_directories(dir / "nothing");
  msg = error_of([&] { build_data("{name: text_file, path: " + (dir / "nothing").string() + "}"); });
  EXPECT_NE(msg.find("no regular file"), std::string::npos) << msg;
}

void write_cifar(const std::filesystem::path& file, int64_t records, uint8_t label = 3, int64_t chop = 0) {
  std::string bytes;
  for (int64_t r = 0; r < records; ++r) {
    bytes.push_back(static_cast<char>(label));
    bytes.append(3072, static_cast<char>(r));
  }
  bytes.resize(bytes.size() - chop);
  std::ofstream(file, std::ios::binary) << bytes;
}

std::filesystem::path cifar_dir(const std::string& name) {
  auto dir = temp_dir(name);
  for (int i = 1; i <= 5; ++i) write_cifar(dir / ("data_batch_" + std::to_string(i) + ".bin"), 4);
  write_cifar(dir / "test_batch.bin", 3);
  return dir;
}

TEST(Cifar10, ReadsTheBinaryBatches) {
  auto dir = cifar_dir("cifar_ok");
  auto dm = build_data("{name: cifar10, root: " + dir.string() + ", val_size: 2, batch_size: 18, num_workers: 0, shuffle: false}");
  EXPECT_EQ(dm->train_loader()->dataset().size(), 18);
  EXPECT_EQ(dm->val_loader()->dataset().size(), 2);
  EXPECT_EQ(dm->test_loader()->dataset().size(), 3);
  auto b = dm->train_loader()->make_batch(0, 0);
  EXPECT_EQ(b.at("image").sizes(), (torch::IntArrayRef{18, 3, 32, 32}));
  EXPECT_TRUE((b.at("label") == 3).all().item<bool>());
}

TEST(Cifar10, BadDataNamesTheFile) {
  auto dir = cifar_dir("cifar_trunc");
  write_cifar(dir / "data_batch_3.bin", 4, 3, /*chop=*/100);
  auto msg = error_of([&] { build_data("{name: cifar10, root: " + dir.string() + ", val_size: 1}"); });
  EXPECT_NE(msg.find((dir / "data_batch_3.bin").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;

  dir = cifar_dir("cifar_label");
  write_cifar(dir / "test_batch.bin", 2, /*label=*/12);
  msg = error_of([&] { build_data("{name: cifar10, root: " + dir.string() + ", val_size: 1}"); });
  EXPECT_NE(msg.find((dir / "test_batch.bin").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("label"), std::string::npos) << msg;

  dir = cifar_dir("cifar_missing");
  std::filesystem::remove(dir / "data_batch_5.bin");
  msg = error_of([&] { build_data("{name: cifar10, root: " + dir.string() + ", val_size: 1}"); });
  EXPECT_NE(msg.find((dir / "data_batch_5.bin").string()), std::string::npos) << msg;

  msg = error_of([&] { build_data("{name: cifar10, root: /nonexistent/cifar}"); });
  EXPECT_NE(msg.find("/nonexistent/cifar"), std::string::npos) << msg;
}

}  // namespace
}  // namespace strobe
