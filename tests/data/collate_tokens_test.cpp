#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/data/collate_tokens.h"

namespace strobe::data {
namespace {

std::vector<Sample> samples() {
  std::vector<Sample> out;
  for (int64_t n : {2, 4, 1}) {
    auto seq = torch::arange(10 * n, 10 * n + n + 1, torch::kInt64);
    out.push_back({{"tokens", seq.narrow(0, 0, n)}, {"targets", seq.narrow(0, 1, n)}});
  }
  return out;
}

TEST(CollateTokens, PadToMaxPadsEverySequenceToTheSameLength) {
  auto s = samples();
  auto b = make_token_collate("pad_to_max", 8)(s);
  EXPECT_EQ(b.at("tokens").sizes(), (torch::IntArrayRef{3, 8}));
  EXPECT_EQ(b.meta.at("batch_size"), 3);
  EXPECT_EQ(b.meta.at("max_seqlen"), 4);
  EXPECT_EQ(b.meta.at("num_tokens"), 7);
  EXPECT_EQ(b.meta.at("seq_len"), 8);
  EXPECT_TRUE(b.at("tokens")[0].equal(torch::tensor({20, 21, 0, 0, 0, 0, 0, 0}, torch::kInt64)));
  EXPECT_TRUE(b.at("targets")[0].equal(torch::tensor({21, 22, -100, -100, -100, -100, -100, -100}, torch::kInt64)));
  EXPECT_TRUE(b.at("position_ids")[1].equal(torch::tensor({0, 1, 2, 3, 0, 0, 0, 0}, torch::kInt64)));
  EXPECT_EQ(b.at("padding_mask").sum().item<int64_t>(), 7);
  EXPECT_TRUE(b.at("lengths").equal(torch::tensor({2, 4, 1}, torch::kInt64)));
}

TEST(CollateTokens, PadToLongestUsesTheBatchsLongestSequence) {
  auto s = samples();
  auto b = make_token_collate("pad_to_longest", 8)(s);
  EXPECT_EQ(b.at("tokens").sizes(), (torch::IntArrayRef{3, 4}));
  EXPECT_TRUE(b.at("padding_mask")[2].equal(torch::tensor({1, 0, 0, 0}, torch::kBool)));
}

TEST(CollateTokens, PackConcatenatesWithInt32CuSeqlensAndHostMaxSeqlen) {
  auto s = samples();
  auto b = make_token_collate("pack", 8)(s);
  EXPECT_TRUE(b.at("tokens").equal(torch::tensor({20, 21, 40, 41, 42, 43, 10}, torch::kInt64)));
  EXPECT_TRUE(b.at("targets").equal(torch::tensor({21, 22, 41, 42, 43, 44, 11}, torch::kInt64)));
  EXPECT_TRUE(b.at("position_ids").equal(torch::tensor({0, 1, 0, 1, 2, 3, 0}, torch::kInt64)));
  EXPECT_EQ(b.at("cu_seqlens").scalar_type(), torch::kInt32);
  EXPECT_TRUE(b.at("cu_seqlens").equal(torch::tensor({0, 2, 6, 7}, torch::kInt32)));
  EXPECT_EQ(b.meta.at("max_seqlen"), 4);
  EXPECT_EQ(b.meta.at("num_tokens"), 7);
  EXPECT_EQ(b.meta.at("batch_size"), 3);
}

TEST(CollateTokens, PadToMaxRejectsALongerSequenceAndUnknownStrategies) {
  auto s = samples();
  EXPECT_THROW(make_token_collate("pad_to_max", 3)(s), std::runtime_error);
  EXPECT_THROW(make_token_collate("bucket", 3), std::invalid_argument);
}

}  // namespace
}  // namespace strobe::data
