// strobe predict: an image folder (3 colour classes, a corrupt test image skipped by on_bad_sample:
// skip) trained briefly; predict's CSV holds one row per readable test image in dataset order, each
// row's file and class name those of its dataset index, and its accuracy equals `strobe test`'s
// micro-averaged accuracy; the safetensors output holds the same predictions as raw outputs; a
// language model's per-token losses average to `strobe test`'s loss; bad outputs are one line and
// exit 2 before any work, an existing file is kept.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <torch/torch.h>

#include "data/image_codec.h"
#include "strobe/checkpoint/safetensors.h"
#include "tests/cli/cli_test_util.h"

namespace strobe::testing {
namespace {

namespace fs = std::filesystem;

void write_bytes(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

// root/{red,green,blue}/<i>.png: 12x12 images of the class's colour with noise.
void write_colour_folder(const fs::path& root, int per_class, int seed) {
  const char* names[3] = {"red", "green", "blue"};
  std::mt19937 rng(seed);
  for (int c = 0; c < 3; ++c)
    for (int i = 0; i < per_class; ++i) {
      std::vector<uint8_t> px(12 * 12 * 3);
      for (size_t k = 0; k < px.size(); ++k) px[k] = static_cast<uint8_t>((k % 3 == static_cast<size_t>(c) ? 150 : 40) + rng() % 100);
      write_bytes(root / names[c] / (std::to_string(i) + ".png"), data::encode_png(px.data(), 12, 12, 3));
    }
}

std::vector<std::vector<std::string>> read_rows(const std::string& path) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream in(slurp(path));
  for (std::string line; std::getline(in, line);) rows.push_back(split_any(line, ","));
  return rows;
}


}  // namespace

TEST(CliPredict, CsvRowsFollowTheDatasetAndMatchTestAccuracy) {
  const fs::path dir = temp_dir("predict");
  write_colour_folder(dir / "train", 8, 1);
  write_colour_folder(dir / "test", 5, 2);
  write_bytes(dir / "test" / "green" / "2.png", "not an image");  // index 7 (blue 0-4, green 5-9, red 10-14)
  const std::string cfg = write_config(fmt::format(R"(name: predict
seed: 4
trainer: {{max_steps: 12, device: cpu, enable_progress_bar: false, num_sanity_val_steps: 0, limit_val_batches: 0}}
model: {{name: mlp, in_features: 432, hidden: [16], num_classes: 3}}
task: {{name: classification, average: micro}}
data: {{name: image_folder, root: {0}/train, val_root: {0}/test, image_size: 12, resize_size: 12, hflip: false,
       train_transform: resize, on_bad_sample: skip, batch_size: 4, num_workers: 0}}
optimizer: {{name: adamw, lr: 0.05}}
)",
                                                   dir.string()));
  auto fit = strobe_cmd("fit -c " + cfg + " --run-dir " + (dir / "run").string());
  ASSERT_EQ(fit.code, 0) << fit.err;
  const std::string ckpt = (dir / "run" / "checkpoints" / "last.ckpt").string();
  auto test = strobe_cmd("test -c " + cfg + " --ckpt " + ckpt);
  ASSERT_EQ(test.code, 0) << test.err;
  const double test_acc = printed_metric(test.out, "test/acc");
  ASSERT_TRUE(std::isfinite(test_acc)) << test.out;

  const std::string csv = (dir / "p.csv").string();
  auto p = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " -o " + csv);
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_NE(p.out.find("strobe predict: 14 samples of the test split (checkpoint " + ckpt + ") written to " + csv), std::string::npos)
      << p.out;
  const auto rows = read_rows(csv);
  ASSERT_EQ(rows.size(), 15u) << slurp(csv);
  EXPECT_EQ(rows[0], (std::vector<std::string>{"index", "file", "class_name", "predicted", "probability", "top5"}));
  const std::vector<std::string> classes = {"blue", "green", "red"};
  int correct = 0;
  for (size_t r = 1; r < rows.size(); ++r) {
    const auto& row = rows[r];
    ASSERT_EQ(row.size(), 6u) << r;
    const int64_t index = std::stoll(row[0]);
    EXPECT_NE(index, 7) << "the corrupt image has no row";
    EXPECT_EQ(index, static_cast<int64_t>(r - 1) + (r - 1 >= 7 ? 1 : 0)) << "rows in dataset order";
    // Files are listed per class in order, sorted by name: index 5 * class + position.
    const int64_t label = index / 5;
    EXPECT_EQ(row[1], (dir / "test" / classes[label] / (std::to_string(index % 5) + ".png")).string());
    const int64_t predicted = std::stoll(row[3]);
    EXPECT_EQ(row[2], classes.at(predicted));
    const double prob = std::stod(row[4]);
    EXPECT_GT(prob, 1.0 / 3 - 1e-9);
    EXPECT_LE(prob, 1.0);
    const auto top = split_any(row[5], " ");
    ASSERT_EQ(top.size(), 3u);
    EXPECT_EQ(std::stoll(top[0]), predicted);
    correct += predicted == label;
  }
  EXPECT_NEAR(correct / 14.0, test_acc, 1e-6) << "predict's accuracy against strobe test's\n" << test.out;

  // The same predictions as raw outputs, with their indices.
  const std::string st = (dir / "p.safetensors").string();
  auto q = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " -o " + st);
  ASSERT_EQ(q.code, 0) << q.err;
  const auto file = safetensors::read_file(st);
  std::map<std::string, torch::Tensor> t(file.tensors.begin(), file.tensors.end());
  ASSERT_EQ(t.at("outputs").sizes(), (std::vector<int64_t>{14, 3}));
  const auto argmax = t.at("outputs").argmax(1);
  for (size_t r = 1; r < rows.size(); ++r) {
    EXPECT_EQ(t.at("index")[r - 1].item<int64_t>(), std::stoll(rows[r][0]));
    EXPECT_EQ(argmax[r - 1].item<int64_t>(), std::stoll(rows[r][3]));
  }

  // The validation split by --split val (here the same folder) with the progress bar, and bad outputs: exit 2, one line,
  // before any work; an existing file is kept.
  auto v = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " --split val --set trainer.enable_progress_bar=true --set "
                      "trainer.log_every_n_steps=1 -o " + (dir / "v.csv").string());
  EXPECT_EQ(v.code, 0) << v.err;
  EXPECT_NE(v.out.find("predict batch 4 "), std::string::npos) << "the progress bar's lines:\n" << v.out;
  EXPECT_EQ(slurp((dir / "v.csv").string()), slurp(csv));
  const std::string before = slurp(csv);
  struct Case {
    std::string args, expect;
  };
  for (const Case& c : {Case{"-o " + csv, "strobe predict: -o " + csv + ": exists (pass --overwrite to replace it)"},
                        Case{"-o " + (dir / "p.txt").string(), "expected a .csv or a .safetensors file name"},
                        Case{"-o " + (dir / "nowhere" / "p.csv").string(), "does not exist"},
                        Case{"-o " + (dir / "x.csv").string() + " --split train", "--split train: expected test or val"}}) {
    auto r = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_EQ(r.out, "") << c.args;
  }
  EXPECT_EQ(slurp(csv), before);
  auto over = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " --overwrite -o " + csv);
  EXPECT_EQ(over.code, 0) << over.err;
  auto cls_logits = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " --logits -o " + (dir / "c.safetensors").string());
  EXPECT_EQ(cls_logits.code, 2) << cls_logits.err;
  EXPECT_NE(cls_logits.err.find("--logits: for language models"), std::string::npos) << cls_logits.err;
  EXPECT_FALSE(fs::exists(dir / "c.safetensors"));
  auto ranks = shell_cmd("WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 ",
                         "predict -c " + cfg + " --ckpt " + ckpt + " -o " + (dir / "r.csv").string());
  EXPECT_EQ(ranks.code, 2) << ranks.err;
  EXPECT_NE(ranks.err.find("strobe predict runs as one process"), std::string::npos) << ranks.err;
}

// A language model: token_loss per document (offsets) whose token-weighted mean is `strobe test`'s
// test/loss; a CSV is refused (classification only).
TEST(CliPredict, LanguageModelTokenLossesAverageToTheTestLoss) {
  const fs::path dir = temp_dir("predict-lm");
  const std::string cfg = write_config(R"(name: predict_lm
seed: 2
trainer: {max_steps: 4, device: cpu, enable_progress_bar: false, num_sanity_val_steps: 0, limit_val_batches: 0}
model: {name: llama, vocab_size: 61, embed_dim: 16, depth: 1, num_heads: 2, num_kv_heads: 1, max_seq_len: 16, attention: math}
data: {name: synthetic_tokens, vocab_size: 61, max_seq_len: 16, fixed_length: true, num_samples: 24, num_val_samples: 10,
       batch_size: 4, collate: pack, num_workers: 0}
optimizer: {name: adamw, lr: 0.01}
)");
  auto fit = strobe_cmd("fit -c " + cfg + " --run-dir " + (dir / "run").string());
  ASSERT_EQ(fit.code, 0) << fit.err;
  const std::string ckpt = (dir / "run" / "checkpoints" / "last.ckpt").string();
  auto test = strobe_cmd("test -c " + cfg + " --ckpt " + ckpt);
  ASSERT_EQ(test.code, 0) << test.err;
  const std::string st = (dir / "lm.safetensors").string();
  auto p = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " -o " + st);
  ASSERT_EQ(p.code, 0) << p.err;
  const auto file = safetensors::read_file(st);
  std::map<std::string, torch::Tensor> t(file.tensors.begin(), file.tensors.end());
  const auto offsets = t.at("offsets"), loss = t.at("token_loss"), index = t.at("index");
  ASSERT_EQ(index.numel(), 10);
  ASSERT_EQ(offsets.numel(), 11);
  EXPECT_EQ(offsets[-1].item<int64_t>(), loss.numel());
  EXPECT_TRUE(torch::equal(index, torch::arange(10)));
  EXPECT_TRUE(torch::isfinite(loss).all().item<bool>());
  EXPECT_NEAR(loss.to(torch::kFloat64).mean().item<double>(), printed_metric(test.out, "test/loss"), 2e-5) << test.out;
  // --logits: every token's logits beside its loss, which is their cross-entropy at one token of the
  // vocabulary (its target); past --logits-limit-gib one line, exit 2, no file; a CSV takes none.
  const std::string with_logits = (dir / "lm_logits.safetensors").string();
  p = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " --logits -o " + with_logits);
  ASSERT_EQ(p.code, 0) << p.err;
  const auto lfile = safetensors::read_file(with_logits);
  std::map<std::string, torch::Tensor> lt(lfile.tensors.begin(), lfile.tensors.end());
  const auto logits = lt.at("logits").to(torch::kFloat64);
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{loss.numel(), 61}));
  EXPECT_TRUE(torch::equal(lt.at("token_loss"), loss));
  const auto gap = (torch::logsumexp(logits, 1, true) - logits - loss.to(torch::kFloat64).unsqueeze(1)).abs().amin(1);
  EXPECT_LT(gap.max().item<double>(), 1e-4);
  const std::string big = (dir / "big.safetensors").string();
  auto over_limit = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " --logits --logits-limit-gib 0.000001 -o " + big);
  EXPECT_EQ(over_limit.code, 2) << over_limit.err;
  EXPECT_NE(over_limit.err.find("--logits: the logits of the first "), std::string::npos) << over_limit.err;
  EXPECT_NE(over_limit.err.find("strobe export CKPT --names hf -o DIR"), std::string::npos) << over_limit.err;
  EXPECT_EQ(count_lines(over_limit.err), 1) << over_limit.err;
  EXPECT_FALSE(fs::exists(big));
  auto csv_logits = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " --logits -o " + (dir / "l.csv").string());
  EXPECT_EQ(csv_logits.code, 2) << csv_logits.err;
  EXPECT_NE(csv_logits.err.find("--logits: a CSV holds no logits; write -o X.safetensors"), std::string::npos) << csv_logits.err;
  // No validation set: nothing to predict, one line, exit 2, no file.
  auto none = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " --split val --set data.num_val_samples=0 -o " +
                         (dir / "none.safetensors").string());
  EXPECT_EQ(none.code, 2) << none.err;
  EXPECT_NE(none.err.find("strobe predict: the val split has no samples"), std::string::npos) << none.err;
  EXPECT_FALSE(fs::exists(dir / "none.safetensors"));
  auto csv = strobe_cmd("predict -c " + cfg + " --ckpt " + ckpt + " -o " + (dir / "lm.csv").string());
  EXPECT_EQ(csv.code, 2) << csv.err;
  EXPECT_NE(csv.err.find("a CSV of predicted classes is written for classification"), std::string::npos) << csv.err;
  EXPECT_EQ(count_lines(csv.err), 1) << csv.err;
}

}  // namespace strobe::testing
