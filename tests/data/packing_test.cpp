// data.packing: best_fit (strobe/data/packing.h, docs/DATA.md "Packing"): an epoch's documents
// placed into rows of max_seq_len by best fit decreasing, a batch = batch_size rows. The plan places
// every sample once, whole, in a row that holds it, opening a row only when no open row can take the
// sample (so any two rows together hold more than a row); it is a pure function of the epoch's order
// and the lengths; the loader splits the rows over ranks as the sampler splits samples, starts
// mid-epoch on the uninterrupted run's batches, and leaves excluded samples out of the plan; the
// token_file key refuses what it cannot pack, and a resume cannot change the plan mid-epoch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include <fmt/format.h>

#include "runner/experiment_builder.h"
#include "strobe/core/trainer.h"
#include "strobe/data/collate_tokens.h"
#include "strobe/data/loader.h"
#include "strobe/data/packing.h"
#include "tests/data/data_test_util.h"
#include "tests/data/fit_util.h"
#include "tests/data/real_data_util.h"

namespace strobe {
namespace packing_test {

namespace fs = std::filesystem;
using namespace strobe::testing;

// Sample i: `length[i]` tokens, every one i % 1000 (targets the same), so a batch shows its samples.
class Lengths : public data::Dataset {
 public:
  explicit Lengths(std::vector<int64_t> length) : length_(std::move(length)) {}
  int64_t size() const override { return static_cast<int64_t>(length_.size()); }
  Sample get(int64_t i, at::Generator&) const override {
    auto t = torch::full({length_[i]}, i % 1000, torch::kInt64);
    return {{"tokens", t}, {"targets", t.clone()}};
  }
  int64_t sample_length(int64_t i) const override { return length_.at(i); }

 private:
  std::vector<int64_t> length_;
};

std::vector<int64_t> random_lengths(int n, int64_t most, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> out;
  // Mostly short documents and a tail of long ones, as text corpora have.
  for (int i = 0; i < n; ++i) out.push_back(rng() % 4 == 0 ? 1 + static_cast<int64_t>(rng() % most) : 1 + static_cast<int64_t>(rng() % (most / 4)));
  return out;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

std::vector<int64_t> row(const data::RowPlan& p, int64_t r) {
  return {p.samples.begin() + p.row_begin[r], p.samples.begin() + p.row_begin[r + 1]};
}

}  // namespace packing_test

TEST(Packing, BestFitDecreasingPlacesAKnownCaseAsWorkedByHand) {
  using namespace packing_test;
  // Lengths by sample: 3 5 2 4 1 3 2, rows of 8. Longest first (ties in the epoch's order): 1 3 0 5
  // 2 6 4. 1 opens row 0 (3 free), 3 opens row 1 (4 free), 0 fits row 0 exactly, 5 goes to row 1
  // (1 free), 2 fits nowhere and opens row 2, 6 joins it, 4 fills row 1's last token.
  const std::vector<int64_t> length = {3, 5, 2, 4, 1, 3, 2};
  const auto plan = data::best_fit_rows(iota(7), length, 8, 1, 0, /*shuffle=*/false);
  EXPECT_EQ(plan.samples, (std::vector<int64_t>{1, 0, 3, 5, 4, 2, 6}));
  EXPECT_EQ(plan.row_begin, (std::vector<int64_t>{0, 2, 5, 7}));
  EXPECT_EQ(plan.tokens, 20);
  EXPECT_EQ(plan.padding(), 4);
  // A sample of no token, or longer than a row, is refused naming it.
  EXPECT_EQ(error_of([&] { data::best_fit_rows({0, 1}, {3, 9}, 8, 1, 0, false); }),
            "packing: sample 1 has 9 tokens; a row holds 1 to 8");
  EXPECT_EQ(error_of([&] { data::best_fit_rows({0}, {0}, 8, 1, 0, false); }), "packing: sample 0 has 0 tokens; a row holds 1 to 8");
}

TEST(Packing, EverySampleOnceInARowThatHoldsItAndAnyTwoRowsHoldMoreThanOne) {
  using namespace packing_test;
  const auto length = random_lengths(3000, 128, 5);
  std::vector<int64_t> order = iota(3000);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(9));
  order.resize(2500);  // an epoch need not hold every sample (exclusions, a mix's epoch)
  const auto plan = data::best_fit_rows(order, length, 128, 7, 3, /*shuffle=*/true);
  std::vector<int64_t> placed = plan.samples, want = order;
  std::sort(placed.begin(), placed.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(placed, want);
  int64_t tokens = 0;
  std::vector<int64_t> fill;
  for (int64_t r = 0; r < plan.rows(); ++r) {
    int64_t f = 0;
    for (int64_t i : row(plan, r)) f += length[i];
    ASSERT_LE(f, 128) << "row " << r;
    fill.push_back(f);
    tokens += f;
  }
  EXPECT_EQ(tokens, plan.tokens);
  // A row is opened only when no open row holds the sample: so no two rows fit in one.
  std::sort(fill.begin(), fill.end());
  EXPECT_GT(fill[0] + fill[1], 128);
  // On this mix of lengths that leaves less than 1% of the rows' tokens as padding.
  EXPECT_LT(static_cast<double>(plan.padding()) / static_cast<double>(plan.rows() * 128), 0.01) << plan.padding();
  // A pure function of its inputs; another epoch shuffles the same rows into another order;
  // without shuffling the rows stay in the order they were opened (the longest sample's first).
  const auto again = data::best_fit_rows(order, length, 128, 7, 3, true);
  EXPECT_EQ(again.samples, plan.samples);
  EXPECT_EQ(again.row_begin, plan.row_begin);
  const auto other = data::best_fit_rows(order, length, 128, 7, 4, true);
  EXPECT_NE(other.samples, plan.samples);
  std::set<std::vector<int64_t>> rows_a, rows_b;
  for (int64_t r = 0; r < plan.rows(); ++r) rows_a.insert(row(plan, r)), rows_b.insert(row(other, r));
  EXPECT_EQ(rows_a, rows_b);
  const auto opened = data::best_fit_rows(order, length, 128, 7, 3, false);
  int64_t longest = 0;
  for (int64_t i : order) longest = std::max(longest, length[i]);
  EXPECT_EQ(length[opened.samples[0]], longest);
}

TEST(Packing, TheLoaderBatchesRowsSplitsThemOverRanksStartsMidEpochAndLeavesExcludedSamplesOut) {
  using namespace packing_test;
  auto dataset = std::make_shared<Lengths>(random_lengths(600, 16, 3));
  data::LoaderOptions o;
  o.batch_size = 4;
  o.seed = 11;
  o.pack_row_len = 16;
  auto collate = data::make_token_collate("pack", 16);
  data::DataLoader loader(dataset, collate, o);
  // Batch k holds the plan's rows [4k, 4k + 4): their samples in the plan's order, packed.
  const auto plan = data::best_fit_rows(
      [&] {
        data::SamplerOptions s;
        s.seed = 11;
        return data::DistributedSampler(600, s).indices(2);
      }(),
      [&] {
        std::vector<int64_t> l;
        for (int64_t i = 0; i < 600; ++i) l.push_back(dataset->sample_length(i));
        return l;
      }(),
      16, 11, 2, true);
  ASSERT_EQ(loader.num_batches(2), (plan.rows() + 3) / 4);
  loader.start(2);
  std::vector<Batch> straight;
  std::vector<int64_t> seen;
  while (auto b = loader.next()) {
    const int64_t k = static_cast<int64_t>(straight.size());
    const int64_t rows = std::min<int64_t>(4, plan.rows() - 4 * k);
    EXPECT_EQ(b->meta.at("rows"), rows) << k;
    std::vector<int64_t> want(plan.samples.begin() + plan.row_begin[4 * k], plan.samples.begin() + plan.row_begin[4 * k + rows]);
    ASSERT_EQ(b->indices, want) << "batch " << k;
    EXPECT_LE(b->meta.at("num_tokens"), rows * 16);
    EXPECT_EQ(b->at("cu_seqlens").size(0), static_cast<int64_t>(want.size()) + 1);
    seen.insert(seen.end(), want.begin(), want.end());
    straight.push_back(*b);
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, iota(600));
  // Started at batch 9, as a resume starts it: the uninterrupted batches, bit for bit.
  loader.start(2, 9);
  for (size_t k = 9; k < straight.size(); ++k) {
    auto b = loader.next();
    ASSERT_TRUE(b.has_value()) << k;
    ASSERT_TRUE(torch::equal(b->at("tokens"), straight[k].at("tokens"))) << k;
  }
  EXPECT_FALSE(loader.next().has_value());
  // After 6 rows (a resume under another global batch): the batches are the rows from the 7th on.
  loader.start(2, 0, /*sample_offset=*/6);
  auto b = loader.next();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->indices, std::vector<int64_t>(plan.samples.begin() + plan.row_begin[6], plan.samples.begin() + plan.row_begin[10]));
  // Two ranks: rank r takes rows r, r + 2, ... of the same plan.
  for (int64_t r = 0; r < 2; ++r) {
    auto ro = o;
    ro.rank = r, ro.world_size = 2;
    data::DataLoader ranked(dataset, collate, ro);
    const Batch first = ranked.make_batch(2, 1);
    std::vector<int64_t> want;
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t p = r + 2 * (4 + j);
      want.insert(want.end(), plan.samples.begin() + plan.row_begin[p], plan.samples.begin() + plan.row_begin[p + 1]);
    }
    EXPECT_EQ(first.indices, want) << "rank " << r;
  }
  // data.exclude: the excluded samples are left out of the plan itself.
  auto xo = o;
  xo.exclude["train"] = {plan.samples[0], plan.samples[1], 599};
  data::DataLoader excluded(dataset, collate, xo);
  std::vector<int64_t> rest;
  excluded.start(2);
  while (auto x = excluded.next()) rest.insert(rest.end(), x->indices.begin(), x->indices.end());
  std::sort(rest.begin(), rest.end());
  std::vector<int64_t> want;
  for (int64_t i = 0; i < 600; ++i)
    if (i != plan.samples[0] && i != plan.samples[1] && i != 599) want.push_back(i);
  EXPECT_EQ(rest, want);
}

namespace packing_test {

// `docs` documents of 1..20 tokens (token k of document d: (d + k) % 250), each ended by 256.
fs::path document_file(int docs) {
  auto dir = fresh_dir("packing");
  std::mt19937_64 rng(17);
  std::string bytes;
  for (int d = 0; d < docs; ++d) {
    const int n = 1 + static_cast<int>(rng() % 20);
    for (int k = 0; k <= n; ++k) {
      const uint16_t t = k == n ? 256 : static_cast<uint16_t>((d + k) % 250);
      bytes.append(reinterpret_cast<const char*>(&t), 2);
    }
  }
  write_file(dir / "docs.bin", bytes);
  return dir / "docs.bin";
}

std::string packing_yaml(const fs::path& file, const std::string& extra) {
  return fmt::format("name: token_file\npath: {}\neot_token: 256\nmax_seq_len: 16\nval_fraction: 0.0\nbatch_size: 4\n"
                     "num_workers: 0\n{}",
                     file.string(), extra);
}

}  // namespace packing_test

TEST(Packing, TokenFileBestFitGivesBatchesOfRowsOfWholeDocumentsAndRefusesWhatItCannotPack) {
  using namespace packing_test;
  const auto file = document_file(400);
  auto packed = build_data(packing_yaml(file, "packing: best_fit\n"))->train_loader();
  auto plain = build_data(packing_yaml(file, "collate: pack\n"))->train_loader();
  // 400 documents of 1..20 tokens (one over 16 is two pieces) in rows of 16: fewer batches of 4
  // rows than of 4 documents, each batch's sequences the documents (cu_seqlens at their bounds), and
  // every row but a few full.
  EXPECT_LT(packed->num_batches(0), plain->num_batches(0));
  packed->start(0);
  int64_t tokens = 0, batches = 0;
  while (auto b = packed->next()) {
    ++batches;
    EXPECT_LE(b->meta.at("num_tokens"), b->meta.at("rows") * 16);
    const auto cu = b->at("cu_seqlens");
    ASSERT_EQ(cu.size(0), static_cast<int64_t>(b->indices.size()) + 1);
    for (size_t j = 0; j < b->indices.size(); ++j)
      EXPECT_EQ(cu[j + 1].item<int64_t>() - cu[j].item<int64_t>(), packed->dataset().sample_length(b->indices[j]));
    tokens += b->meta.at("num_tokens");
  }
  EXPECT_EQ(batches, packed->num_batches(0));
  int64_t all = 0;
  for (int64_t i = 0; i < packed->dataset().size(); ++i) all += packed->dataset().sample_length(i);
  EXPECT_EQ(tokens, all);  // no token cropped
  int64_t rows = 0;
  for (int64_t k = 0; k < batches; ++k) rows += packed->make_batch(0, k).meta.at("rows");
  std::printf("%lld tokens in %lld rows of 16: %.2f%% padding\n", static_cast<long long>(tokens), static_cast<long long>(rows),
              100.0 * static_cast<double>(rows * 16 - tokens) / static_cast<double>(rows * 16));
  EXPECT_LT(rows * 16 - tokens, rows * 16 / 100);
  auto err = [&](const std::string& extra) { return error_of([&] { build_data(packing_yaml(file, extra)); }); };
  EXPECT_NE(err("packing: best_fit\nmode: windows\n").find("packing: best_fit packs documents: it needs mode: documents"),
            std::string::npos);
  EXPECT_NE(err("packing: best_fit\ncollate: pad_to_max\n").find("'pad_to_max' with packing: best_fit"), std::string::npos);
  EXPECT_NE(err("packing: first_fit\n").find("packing"), std::string::npos);
}

// A fit on packed rows trains; a resume in the middle of an epoch with packing switched off
// finishes the epoch on the rows it began with (bit for bit the uninterrupted packed run at the
// epoch's end) and says from which epoch the change applies.
TEST(Packing, TheFitLoopTrainsOnRowsAndAnotherPackingAtAMidEpochResumeAppliesFromTheNextEpoch) {
  using namespace packing_test;
  const auto file = document_file(400);
  auto yaml = [&](const std::string& packing) {
    return fmt::format(R"(name: packed
seed: 3
trainer: {{max_steps: 3, log_every_n_steps: 1, num_sanity_val_steps: 0, enable_progress_bar: false, enable_model_summary: false, device: cpu}}
task: {{name: language_modeling}}
model: {{name: decoder_lm, vocab_size: 257, max_seq_len: 16, embed_dim: 16, depth: 1, num_heads: 2}}
data: {{name: token_file, path: {}, eot_token: 256, vocab_size: 257, max_seq_len: 16, val_fraction: 0.0, batch_size: 4, num_workers: 0, collate: pack, packing: {}}}
optimizer: {{name: adamw, lr: 0.001}}
scheduler: {{name: none}}
)",
                       file.string(), packing);
  };
  const auto fit = testing::fit_text;
  const std::string root = fresh_dir("packing-resume").string();
  auto last = [&](const std::string& run) { return root + "/" + run + "/checkpoints/last.ckpt"; };
  // 259 rows of 16 in batches of 4: epoch 0 is 65 steps.
  ASSERT_EQ(fit(yaml("best_fit"), root + "/a", std::nullopt, 3), 0);
  ASSERT_EQ(fit(yaml("best_fit"), root + "/straight", std::nullopt, 65), 0);
  ::testing::internal::CaptureStdout();
  const int rc = fit(yaml("none"), root + "/b", last("a"), 65);
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("; data: data.packing: best_fit -> none from epoch 1 (epoch 0 finishes with the data it began with)"),
            std::string::npos)
      << out;
  const auto x = model_tensors_of(last("b")), y = model_tensors_of(last("straight"));
  ASSERT_EQ(x.size(), y.size());
  for (const auto& [k, v] : x) EXPECT_TRUE(torch::equal(v, y.at(k))) << k;
  // The next epoch is the unpacked one: batches of 4 documents (far more steps in epoch 1).
  ASSERT_EQ(fit(yaml("none"), root + "/c", last("b"), 70), 0);
}

}  // namespace strobe
