// data.sources (strobe/data/mix.h, docs/DATA.md "Mixes"): token files mixed by weight. The schedule
// holds each source within 2 samples of weight x N in every window of N consecutive samples, the
// epoch ends at the first exhausted source, a source's samples are drawn each at most once an epoch
// in a permutation of (seed, epoch), the order is a pure function of (seed, epoch) (a loader started
// mid-epoch, as a resume starts it, makes the uninterrupted run's batches bit for bit), the ranks
// split the mix's order as they split a permutation, and bad sources are one error naming the key.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>

#include "runner/experiment_builder.h"
#include "strobe/core/trainer.h"
#include "strobe/data/data_error.h"
#include "strobe/data/mix.h"
#include "strobe/data/sampler.h"
#include "tests/data/data_test_util.h"
#include "tests/data/fit_util.h"
#include "tests/data/real_data_util.h"

namespace strobe {
namespace token_mix {

namespace fs = std::filesystem;
using namespace strobe::testing;

// `docs` documents of 3 tokens: (first + k) % 250, its length mark, then the end-of-text 256.
std::string documents(int docs, int first) {
  std::string s;
  for (int k = 0; k < docs; ++k)
    for (uint16_t t : {static_cast<uint16_t>((first + k) % 250), static_cast<uint16_t>(251), static_cast<uint16_t>(256)}) {
      char b[2];
      std::memcpy(b, &t, 2);
      s.append(b, 2);
    }
  return s;
}

std::string mix_yaml(const fs::path& dir, const std::string& sources, const std::string& extra = "") {
  return fmt::format("name: token_file\nsources: {}\neot_token: 256\nmax_seq_len: 8\nval_fraction: 0.0\nbatch_size: 4\n"
                     "num_workers: 0\ncollate: pack\n{}",
                     sources, extra);
}

fs::path three_sources() {
  auto dir = fresh_dir("mix");
  write_file(dir / "web.bin", documents(700, 0));
  write_file(dir / "code.bin", documents(300, 100));
  write_file(dir / "books.bin", documents(50, 200));
  return dir;
}

std::string three(const fs::path& dir, double web = 0.6, double code = 0.3, double books = 0.1) {
  return fmt::format("[{{path: {}, weight: {}}}, {{path: {}, weight: {}}}, {{path: {}, weight: {}, name: literature}}]",
                     (dir / "web.bin").string(), web, (dir / "code.bin").string(), code, (dir / "books.bin").string(), books);
}

}  // namespace token_mix

TEST(TokenMix, TheScheduleHoldsTheWeightsInEveryWindowAndEndsAtTheFirstExhaustedSource) {
  namespace tm = token_mix;
  const auto dir = tm::three_sources();
  auto dm = build_data(tm::mix_yaml(dir, tm::three(dir)));
  auto loader = dm->train_loader();
  const auto& mix = dynamic_cast<const data::MixDataset&>(loader->dataset());
  ASSERT_EQ(mix.sources().size(), 3u);
  EXPECT_EQ(mix.sources()[0].name, "web");
  EXPECT_EQ(mix.sources()[2].name, "literature");
  EXPECT_EQ(mix.size(), 700 + 300 + 50);
  // books (50 documents at 0.1) runs out first: the schedule would ask it for a 51st at position
  // 503, so an epoch is 503 samples (302 web, 151 code, all 50 books).
  const int64_t length = mix.epoch_order_size();
  EXPECT_EQ(length, 503);
  const auto order = mix.epoch_order(7, 0, true);
  ASSERT_EQ(static_cast<int64_t>(order.size()), length);
  const double w[3] = {0.6, 0.3, 0.1};
  auto source_of = [&](int64_t index) { return index < 700 ? 0 : index < 1000 ? 1 : 2; };
  for (int n : {10, 100, 333}) {
    for (int64_t start = 0; start + n <= length; ++start) {
      int count[3] = {0, 0, 0};
      for (int64_t p = start; p < start + n; ++p) ++count[source_of(order[p])];
      for (int s = 0; s < 3; ++s) ASSERT_LE(std::abs(count[s] - w[s] * n), 2.0) << "window of " << n << " at " << start << ", source " << s;
    }
  }
  // Each sample at most once an epoch; the order a pure function of (seed, epoch); another epoch
  // draws another part of web and code.
  EXPECT_EQ(std::set<int64_t>(order.begin(), order.end()).size(), order.size());
  EXPECT_EQ(mix.epoch_order(7, 0, true), order);
  EXPECT_NE(mix.epoch_order(7, 1, true), order);
  EXPECT_NE(mix.epoch_order(8, 0, true), order);
  // A sample says its source.
  auto gen = data::sample_generator(7, 0, 0);
  auto s = mix.get(1000, gen);
  EXPECT_EQ(s.at("source").item<int64_t>(), 2);
  EXPECT_EQ(s.at("tokens")[0].item<int64_t>(), 200);
  EXPECT_EQ(mix.describe(1000), fmt::format("source literature: {}: document 0, tokens 0-2", (dir / "books.bin").string()));
  // The loader's epoch is the mix's order, cut into batches.
  int count[3] = {0, 0, 0};
  for (int64_t i : order) ++count[source_of(i)];
  EXPECT_EQ(count[0], 302);
  EXPECT_EQ(count[1], 151);
  EXPECT_EQ(count[2], 50);
  EXPECT_EQ(loader->num_batches(0), (503 + 3) / 4);
}

TEST(TokenMix, ALoaderStartedMidEpochMakesTheUninterruptedBatchesAndTwoRanksSplitTheOrder) {
  namespace tm = token_mix;
  const auto dir = tm::three_sources();
  const std::string yaml = tm::mix_yaml(dir, tm::three(dir));
  auto a = build_data(yaml)->train_loader();
  auto b = build_data(yaml)->train_loader();
  std::vector<Batch> straight;
  a->start(1);
  while (auto batch = a->next()) straight.push_back(*batch);
  ASSERT_EQ(straight.size(), 126u);
  b->start(1, /*first_batch=*/40);
  for (size_t i = 40; i < straight.size(); ++i) {
    auto batch = b->next();
    ASSERT_TRUE(batch.has_value()) << i;
    ASSERT_TRUE(torch::equal(batch->at("tokens"), straight[i].at("tokens"))) << "batch " << i;
  }
  EXPECT_FALSE(b->next().has_value());
  // Two ranks: rank r takes every second sample of the mix's order, so together they hold it.
  const auto& mix = dynamic_cast<const data::MixDataset&>(a->dataset());
  const auto order = mix.epoch_order(7, 3, true);
  std::vector<std::vector<int64_t>> ranks;
  for (int r = 0; r < 2; ++r) {
    data::SamplerOptions o;
    o.seed = 7, o.rank = r, o.world_size = 2;
    o.order_size = mix.epoch_order_size();
    o.order = [&](int64_t epoch) { return mix.epoch_order(7, epoch, true); };
    ranks.push_back(data::DistributedSampler(mix.size(), o).indices(3));
  }
  // 503 samples: rank 1's last is the order's first again (the padding of drop_last: false).
  ASSERT_EQ(ranks[0].size() + ranks[1].size(), order.size() + 1);
  for (size_t p = 0; p < order.size(); ++p) EXPECT_EQ(ranks[p % 2][p / 2], order[p]) << p;
  EXPECT_EQ(ranks[1].back(), order[0]);
}

TEST(TokenMix, BadSourcesAreOneErrorNamingTheKey) {
  namespace tm = token_mix;
  const auto dir = tm::three_sources();
  auto err = [&](const std::string& sources, const std::string& extra = "") {
    return error_of([&] { build_data(tm::mix_yaml(dir, sources, extra)); });
  };
  const std::string web = (dir / "web.bin").string(), code = (dir / "code.bin").string();
  for (const char* w : {"0", "-1"})
    EXPECT_NE(err(fmt::format("[{{path: {}}}, {{path: {}, weight: {}}}]", web, code, w))
                  .find(fmt::format("sources[1].weight: expected a finite number > 0, got {}", w)),
              std::string::npos)
        << w;
  for (const char* w : {".nan", ".inf"})
    EXPECT_NE(err(fmt::format("[{{path: {}}}, {{path: {}, weight: {}}}]", web, code, w))
                  .find(fmt::format("sources[1].weight: expected a number, got '{}'", w)),
              std::string::npos)
        << w;
  EXPECT_NE(err(fmt::format("[{{path: {}}}, {{path: {}, name: web}}]", web, code)).find("'web' is also the name of source 0"),
            std::string::npos);
  EXPECT_NE(err(fmt::format("[{{path: {}}}]", web), "path: " + web + "\n").find("give either path or sources, not both"),
            std::string::npos);
  EXPECT_NE(err("[]").find("expected at least one source"), std::string::npos);
  // Files of two tokenizers (their sidecars, scripts/tokenize_text.py's) cannot be mixed.
  write_file(dir / "web.bin.json", R"({"format": "strobe token file", "dtype": "uint16", "vocab_size": 257, "eot_token": 256})");
  write_file(dir / "code.bin.json", R"({"format": "strobe token file", "dtype": "uint16", "vocab_size": 300, "eot_token": 256})");
  EXPECT_NE(err(fmt::format("[{{path: {}}}, {{path: {}}}]", web, code)).find("files of other tokenizers cannot be mixed"),
            std::string::npos);
  fs::remove(dir / "web.bin.json");
  fs::remove(dir / "code.bin.json");
  write_file(dir / "empty.bin", "");
  EXPECT_EQ(err(fmt::format("[{{path: {}}}, {{path: {}}}]", web, (dir / "empty.bin").string())),
            (dir / "empty.bin").string() + ": empty token file");
}

}  // namespace strobe

namespace strobe {

// Training on the mix: the fit loop logs each source's share of every step's tokens
// (train/tokens/<name>, on the device); batches of 20 equal samples hold each share within 0.1.
TEST(TokenMix, TheFitLoopLogsEachSourcesShareOfTheTokens) {
  namespace tm = token_mix;
  const auto dir = tm::three_sources();
  const std::string yaml = fmt::format(R"(name: mix
seed: 3
trainer: {{max_steps: 6, log_every_n_steps: 1, num_sanity_val_steps: 0, enable_progress_bar: false, enable_checkpointing: false, enable_model_summary: false, device: cpu}}
task: {{name: language_modeling}}
model: {{name: decoder_lm, vocab_size: 257, max_seq_len: 8, embed_dim: 16, depth: 1, num_heads: 2}}
data: {{name: token_file, sources: {}, eot_token: 256, vocab_size: 257, max_seq_len: 8, val_fraction: 0.0, batch_size: 20, num_workers: 0, collate: pack}}
optimizer: {{name: adamw, lr: 0.001}}
scheduler: {{name: none}}
logger: {{csv: false}}
)",
                                       tm::three(dir));
  auto doc = config::Document::load_string(yaml, "mix.yaml");
  RunOptions opt;
  opt.create_run_dir = false;
  auto run = build_run(doc, opt);
  ASSERT_EQ(run->trainer->fit(), 0);
  const auto& m = run->trainer->view().metrics();
  double sum = 0;
  for (const auto& [name, w] : std::vector<std::pair<std::string, double>>{{"web", 0.6}, {"code", 0.3}, {"literature", 0.1}}) {
    ASSERT_TRUE(m.count("train/tokens/" + name)) << name;
    EXPECT_NEAR(m.at("train/tokens/" + name), w, 0.1) << name;
    sum += m.at("train/tokens/" + name);
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
}

}  // namespace strobe

namespace strobe {

// A resume in the middle of an epoch under other weights: the epoch finishes with the mix it began
// with and the new weights apply from the next epoch, said in the resume line. Bit for bit on the
// CPU: resumed at step 3 with 0.5, the run's weights at the epoch's end (step 26) are those of the
// uninterrupted 0.6 run; a checkpoint taken inside that finishing epoch (step 10) resumed again ends
// there too (it records the config the epoch began under); and the next epoch's steps equal a resume
// of the uninterrupted run's epoch-end checkpoint under 0.5.
TEST(TokenMix, AnotherMixAtAMidEpochResumeAppliesFromTheNextEpoch) {
  namespace tm = token_mix;
  const auto dir = tm::three_sources();
  auto yaml = [&](double web) {
    return fmt::format(R"(name: mix
seed: 3
trainer: {{max_steps: 3, log_every_n_steps: 1, num_sanity_val_steps: 0, enable_progress_bar: false, enable_model_summary: false, device: cpu}}
task: {{name: language_modeling}}
model: {{name: decoder_lm, vocab_size: 257, max_seq_len: 8, embed_dim: 16, depth: 1, num_heads: 2}}
data: {{name: token_file, sources: {}, eot_token: 256, vocab_size: 257, max_seq_len: 8, val_fraction: 0.0, batch_size: 20, num_workers: 0, collate: pack}}
optimizer: {{name: adamw, lr: 0.001}}
scheduler: {{name: none}}
)",
                       tm::three(dir, web));
  };
  const auto fit = testing::fit_text;
  auto same = [](const std::string& a, const std::string& b) {
    const auto x = model_tensors_of(a), y = model_tensors_of(b);
    if (x.size() != y.size() || x.empty()) return false;
    for (const auto& [k, v] : x)
      if (!y.count(k) || !torch::equal(v, y.at(k))) return false;
    return true;
  };
  const std::string root = fresh_dir("mix-resume").string();
  auto last = [&](const std::string& run) { return root + "/" + run + "/checkpoints/last.ckpt"; };
  // 503 samples of 0.6 / 0.3 / 0.1 in batches of 20: epoch 0 is 26 steps.
  ASSERT_EQ(fit(yaml(0.6), root + "/a", std::nullopt, 3), 0);
  ASSERT_EQ(fit(yaml(0.6), root + "/straight", std::nullopt, 26), 0);
  ::testing::internal::CaptureStdout();
  const int rc = fit(yaml(0.5), root + "/b", last("a"), 26);
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("; data: data.sources[0].weight: 0.6 -> 0.5 from epoch 1 (epoch 0 finishes with the data it began with)"),
            std::string::npos)
      << out;
  EXPECT_TRUE(same(last("b"), last("straight"))) << "epoch 0 did not finish with the mix it began with";
  // A checkpoint inside the finishing epoch, resumed again under 0.5.
  ASSERT_EQ(fit(yaml(0.5), root + "/c", last("a"), 10), 0);
  ASSERT_EQ(fit(yaml(0.5), root + "/d", last("c"), 26), 0);
  EXPECT_TRUE(same(last("d"), last("straight"))) << "a checkpoint of the finishing epoch lost the mix it began with";
  // The next epoch under the new weights: as a resume of the uninterrupted run's epoch end.
  ASSERT_EQ(fit(yaml(0.5), root + "/e", last("b"), 30), 0);
  ASSERT_EQ(fit(yaml(0.5), root + "/f", last("straight"), 30), 0);
  EXPECT_TRUE(same(last("e"), last("f")));
  // And the new weights do apply there: not the run that kept 0.6.
  ASSERT_EQ(fit(yaml(0.6), root + "/g", last("straight"), 30), 0);
  EXPECT_FALSE(same(last("e"), last("g")));
}

}  // namespace strobe

namespace strobe {

// Validation of a mix with each source's val_path reports val/<name>/loss beside val/loss: the loss
// over that source's tokens alone (the others' targets ignored), equal to validating on that
// source's file alone; val/loss stays the loss over every token. Through the logits and through the
// fused head (fused_linear_loss).
TEST(TokenMix, ValidationReportsEachSourcesLossBesideTheTotal) {
  namespace tm = token_mix;
  const auto dir = tm::three_sources();
  tm::write_file(dir / "web_val.bin", tm::documents(40, 10));
  tm::write_file(dir / "code_val.bin", tm::documents(20, 120));
  auto metrics = [&](const std::string& data, const std::string& fused) {
    const std::string yaml = fmt::format(R"(name: mix
seed: 3
trainer: {{enable_progress_bar: false, enable_model_summary: false, device: cpu}}
task: {{name: language_modeling, fused_linear_loss: {}}}
model: {{name: decoder_lm, vocab_size: 257, max_seq_len: 8, embed_dim: 16, depth: 1, num_heads: 2}}
data: {{name: token_file, {}, eot_token: 256, vocab_size: 257, max_seq_len: 8, batch_size: 7, num_workers: 0, collate: pack}}
)",
                                         fused, data);
    auto doc = config::Document::load_string(yaml, "mix.yaml");
    RunOptions opt;
    opt.stage = Stage::Validate;
    opt.create_run_dir = false;
    auto run = build_run(doc, opt);
    run->trainer->validate(std::move(run->checkpoint));
    return run->trainer->view().metrics();
  };
  const std::string web = (dir / "web.bin").string(), code = (dir / "code.bin").string();
  for (const std::string fused : {"false", "true"}) {
    const auto mix = metrics(fmt::format("sources: [{{path: {}, val_path: {}}}, {{path: {}, val_path: {}}}]", web,
                                         (dir / "web_val.bin").string(), code, (dir / "code_val.bin").string()),
                             fused);
    const auto web_only = metrics(fmt::format("path: {}, val_path: {}", web, (dir / "web_val.bin").string()), fused);
    const auto code_only = metrics(fmt::format("path: {}, val_path: {}", code, (dir / "code_val.bin").string()), fused);
    ASSERT_TRUE(mix.count("val/web/loss") && mix.count("val/code/loss")) << fused;
    EXPECT_NEAR(mix.at("val/web/loss"), web_only.at("val/loss"), 1e-5 * web_only.at("val/loss")) << fused;
    EXPECT_NEAR(mix.at("val/code/loss"), code_only.at("val/loss"), 1e-5 * code_only.at("val/loss")) << fused;
    // Every sequence is 2 tokens: the total is the mean over 40 web and 20 code sequences.
    const double total = (40 * web_only.at("val/loss") + 20 * code_only.at("val/loss")) / 60;
    EXPECT_NEAR(mix.at("val/loss"), total, 1e-5 * total) << fused;
    EXPECT_GT(std::abs(mix.at("val/web/loss") - mix.at("val/code/loss")), 1e-4) << "the two sources' data differ";
  }
}

}  // namespace strobe

namespace strobe {

// data.exclude (quarantined samples) leaves the mix's order: the epoch is the order less the
// excluded samples it holds, in the same order.
TEST(TokenMix, ExcludedSamplesLeaveTheMixsOrder) {
  namespace tm = token_mix;
  const auto dir = tm::three_sources();
  auto dm = build_data(tm::mix_yaml(dir, tm::three(dir)));
  const auto& mix = dynamic_cast<const data::MixDataset&>(dm->train_loader()->dataset());
  const auto order = mix.epoch_order(7, 0, true);
  data::SamplerOptions o;
  o.seed = 7;
  o.order_size = mix.epoch_order_size();
  o.order = [&](int64_t epoch) { return mix.epoch_order(7, epoch, true); };
  o.exclude = {order[5], order[0], 1049};  // two of the epoch's samples, and books' last document
  std::sort(o.exclude.begin(), o.exclude.end());
  const bool last_drawn = std::find(order.begin(), order.end(), 1049) != order.end();
  data::DistributedSampler sampler(mix.size(), o);
  std::vector<int64_t> want;
  for (int64_t i : order)
    if (!std::binary_search(o.exclude.begin(), o.exclude.end(), i)) want.push_back(i);
  EXPECT_EQ(static_cast<int64_t>(want.size()), mix.epoch_order_size() - 2 - (last_drawn ? 1 : 0));
  EXPECT_EQ(sampler.num_samples(0), static_cast<int64_t>(want.size()));
  EXPECT_EQ(sampler.num_samples(0), static_cast<int64_t>(want.size())) << "asked again";
  EXPECT_EQ(sampler.indices(0), want);
}

}  // namespace strobe
