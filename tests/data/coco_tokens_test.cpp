// coco_boxes (images with 0, 1 and many boxes, scaling, the max_boxes cut and padding rule, bad
// annotations), token_file (uint16 and uint32 files from the fortunes text, documents and windows,
// bad sizes and tokens) and the exit status of corrupt IDX / CIFAR files.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "data/idx_file.h"
#include "data/image_codec.h"
#include "data/image_transforms.h"
#include "strobe/data/data_error.h"
#include "tests/data/real_data_util.h"
#include "tests/source_path.h"

namespace strobe {
namespace {

namespace fs = std::filesystem;
using namespace strobe::testing;
using data::DataError;

// Three images: a.jpg 200x100 with no box, b.png 100x100 with one, c.jpg 160x120 with six (one crowd).
fs::path coco_fixture(const std::string& name, const std::string& extra_annotation = "") {
  auto dir = fresh_dir(name);
  std::vector<uint8_t> px(200 * 120 * 3);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i % 200);
  write_file(dir / "a.jpg", data::encode_jpeg(px.data(), 200, 100, 3, 90));
  write_file(dir / "b.png", data::encode_png(px.data(), 100, 100, 1));
  write_file(dir / "c.jpg", data::encode_jpeg(px.data(), 160, 120, 1, 90));
  write_file(dir / "ann.json", R"({"images": [
    {"id": 1, "file_name": "a.jpg", "width": 200, "height": 100},
    {"id": 2, "file_name": "b.png", "width": 100, "height": 100},
    {"id": 7, "file_name": "c.jpg"}],
   "annotations": [
    {"id": 10, "image_id": 2, "bbox": [10, 20, 30, 40], "category_id": 1},
    {"id": 11, "image_id": 7, "bbox": [80, 60, 16, 12], "category_id": 1},
    {"id": 12, "image_id": 7, "bbox": [0, 0, 160, 120], "category_id": 1},
    {"id": 13, "image_id": 7, "bbox": [40, 30, 8, 8], "category_id": 1},
    {"id": 14, "image_id": 7, "bbox": [40, 6, 8, 8], "category_id": 1},
    {"id": 15, "image_id": 7, "bbox": [4, 30, 8, 8], "category_id": 1},
    {"id": 16, "image_id": 7, "bbox": [1, 1, 2, 2], "category_id": 1, "iscrowd": 1},
    {"id": 17, "image_id": 7, "bbox": [150, 110, 20, 20], "category_id": 1})" + extra_annotation + R"(],
   "categories": [{"id": 1, "name": "face"}]})");
  return dir;
}

std::string coco_yaml(const fs::path& dir, const std::string& extra = "") {
  return "name: coco_boxes\nannotations: " + (dir / "ann.json").string() + "\nimage_size: 64\nmax_boxes: 4\nshuffle: false\nnum_workers: 0\nbatch_size: 3\n" + extra;
}

TEST(CocoBoxes, ImagesWithZeroOneAndManyBoxesAreScaledSortedCutAndPadded) {
  auto dir = coco_fixture("coco_ok");
  auto dm = build_data(coco_yaml(dir));
  auto b = dm->train_loader()->make_batch(0, 0);
  // Each sample names its image file (strobe replay --bisect, strobe predict).
  for (int64_t i : b.indices) {
    const std::string file = dm->train_loader()->dataset().describe(i);
    EXPECT_TRUE(fs::exists(file) && file.rfind(dir.string(), 0) == 0) << file;
  }
  EXPECT_EQ(b.at("image").sizes(), (std::vector<int64_t>{3, 1, 64, 64}));
  EXPECT_EQ(b.at("image").scalar_type(), torch::kUInt8);
  EXPECT_EQ(b.at("boxes").sizes(), (std::vector<int64_t>{3, 4, 4}));
  auto n = b.at("num_boxes");
  EXPECT_EQ(n[0].item<int64_t>(), 0);
  EXPECT_EQ(n[1].item<int64_t>(), 1);
  EXPECT_EQ(n[2].item<int64_t>(), 4);  // six boxes, one crowd left out, cut to max_boxes = 4
  EXPECT_EQ(b.at("boxes")[0].abs().sum().item<float>(), 0.f);  // all padding: y2 = 0
  // b.png 100x100 -> 64: [10, 20, 40, 60] * 0.64.
  auto want1 = torch::tensor({6.4f, 12.8f, 25.6f, 38.4f});
  EXPECT_TRUE(torch::allclose(b.at("boxes")[1][0], want1)) << b.at("boxes")[1][0];
  EXPECT_EQ(b.at("boxes")[1].narrow(0, 1, 3).abs().sum().item<float>(), 0.f);
  // c.jpg 160x120 -> 64 (x * 0.4, y * 64/120), sorted by (y1, x1): ids 12, 14, 15, 13 (11 and 17 cut).
  auto c = b.at("boxes")[2];
  const double fy = 64.0 / 120;
  auto want2 = torch::tensor({{0.0, 0.0, 64.0, 64.0}, {16.0, 6 * fy, 19.2, 14 * fy}, {1.6, 30 * fy, 4.8, 38 * fy}, {16.0, 30 * fy, 19.2, 38 * fy}},
                             torch::kFloat32);
  EXPECT_TRUE(torch::allclose(c, want2, 1e-5, 1e-4)) << c;
  for (int i = 0; i < 4; ++i) EXPECT_GT(c[i][3].item<float>(), 0.f);  // every real row is valid under y2 > 0
  // The image is the file resized: b.png's pixel rows are i % 200 over a 100-wide grey image.
  auto img = data::decode_image(data::read_file_bytes((dir / "b.png").string()), "b.png", 1);
  auto resized = torch::empty({1, 64, 64}, torch::kUInt8);
  data::resample_to_u8(img, data::whole_image_box(100, 100), 64, 64, resized.data_ptr<uint8_t>());
  EXPECT_TRUE(torch::equal(b.at("image")[1], resized));
  EXPECT_GT(resized.to(torch::kFloat32).std().item<float>(), 10.f);
}

TEST(CocoBoxes, BadAnnotationsNameTheFileOrAreSkippedAndCounted) {
  auto dir = coco_fixture("coco_bad", R"(,
    {"id": 20, "image_id": 99, "bbox": [1, 1, 2, 2]},
    {"id": 21, "image_id": 2, "bbox": [1, 1, 0, 2]})");
  const std::string ann = (dir / "ann.json").string();
  EXPECT_EQ(error_of([&] { build_data(coco_yaml(dir)); }), ann + ": annotation 20 refers to image_id 99, which no image has");
  auto dm = build_data(coco_yaml(dir, "on_bad_sample: skip\n"));
  EXPECT_EQ(dm->train_loader()->make_batch(0, 0).at("num_boxes")[1].item<int64_t>(), 1);  // the degenerate box is out
  // A missing image file.
  fs::remove(dir / "b.png");
  write_file(dir / "ann.json", R"({"images": [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": "b.png"}], "annotations": []})");
  EXPECT_EQ(error_of([&] { build_data(coco_yaml(dir)); }), (dir / "b.png").string() + ": image 2 of " + ann + " is missing");
  write_file(dir / "ann.json", "{\"images\": [");
  EXPECT_EQ(error_of([&] { build_data(coco_yaml(dir)); }).rfind(ann + ": not valid JSON", 0), 0u);
  // An image whose size differs from its annotation.
  write_file(dir / "ann.json", R"({"images": [{"id": 1, "file_name": "a.jpg", "width": 20, "height": 10}]})");
  auto dm2 = build_data(coco_yaml(dir));
  EXPECT_EQ(error_of([&] { dm2->train_loader()->make_batch(0, 0); }),
            (dir / "a.jpg").string() + ": the image is 200x100 but its annotation says 20x10");
}

// The fortunes file as byte tokens, each fortune followed by `eot`; token = byte + offset.
std::vector<uint32_t> fortune_tokens(uint32_t offset, uint32_t eot, std::vector<std::string>* docs) {
  std::string text = slurp("/usr/share/games/fortunes/fortunes");
  std::vector<uint32_t> out;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find("\n%\n", begin);
    if (end == std::string::npos) end = text.size();
    std::string doc = text.substr(begin, end - begin);
    docs->push_back(doc);
    for (unsigned char ch : doc) out.push_back(ch + offset);
    out.push_back(eot);
    begin = end + 3;
  }
  return out;
}

template <typename T>
std::string as_bytes(const std::vector<uint32_t>& tokens) {
  std::string s(tokens.size() * sizeof(T), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    T v = static_cast<T>(tokens[i]);
    std::memcpy(&s[i * sizeof(T)], &v, sizeof(T));
  }
  return s;
}

TEST(TokenFile, Uint16AndUint32FilesSplitIntoDocumentsAtTheEndOfTextToken) {
  if (!fs::exists("/usr/share/games/fortunes/fortunes")) GTEST_SKIP() << "fortunes is not installed";
  for (int width : {2, 4}) {
    std::vector<std::string> docs;
    const uint32_t offset = width == 2 ? 0 : 70000, eot = width == 2 ? 256 : 99999;
    auto tokens = fortune_tokens(offset, eot, &docs);
    auto dir = fresh_dir("tok");
    write_file(dir / "train.bin", width == 2 ? as_bytes<uint16_t>(tokens) : as_bytes<uint32_t>(tokens));
    auto dm = build_data(fmt::format("name: token_file\npath: {}\ndtype: uint{}\neot_token: {}\nmax_seq_len: 4096\nval_fraction: 0.0\n"
                                     "shuffle: false\nbatch_size: 4\nnum_workers: 0\ncollate: pack\nvocab_size: {}\n",
                                     (dir / "train.bin").string(), width * 8, eot, eot + 1));
    auto loader = dm->train_loader();
    ASSERT_EQ(loader->dataset().size(), static_cast<int64_t>(docs.size())) << width;
    for (int64_t i : {int64_t(0), int64_t(1), static_cast<int64_t>(docs.size()) - 1}) {
      auto gen = data::sample_generator(0, 0, i);
      auto s = loader->dataset().get(i, gen);
      // tokens = the document's bytes (+ offset); targets = shifted by one, ending in the end-of-text token.
      const std::string& d = docs[i];
      ASSERT_EQ(s.at("tokens").size(0), static_cast<int64_t>(d.size())) << i;
      for (size_t k = 0; k < d.size(); ++k) ASSERT_EQ(s.at("tokens")[k].item<int64_t>(), int64_t((unsigned char)d[k]) + offset);
      EXPECT_EQ(s.at("targets")[d.size() - 1].item<int64_t>(), eot);
      // describe: the file, the document and the token offsets (the document's tokens and its end-of-text).
      int64_t start = 0;
      for (int64_t j = 0; j < i; ++j) start += static_cast<int64_t>(docs[j].size()) + 1;
      EXPECT_EQ(loader->dataset().describe(i), fmt::format("{}: document {}, tokens {}-{}", (dir / "train.bin").string(), i, start,
                                                            start + static_cast<int64_t>(d.size())));
    }
    auto b = loader->make_batch(0, 0);
    EXPECT_EQ(b.meta.at("num_tokens"), static_cast<int64_t>(docs[0].size() + docs[1].size() + docs[2].size() + docs[3].size()));
    EXPECT_EQ(b.at("cu_seqlens").size(0), 5);
  }
}

TEST(TokenFile, LongDocumentsAreCutAndWindowsModeIsFixedLength) {
  if (!fs::exists("/usr/share/games/fortunes/fortunes")) GTEST_SKIP() << "fortunes is not installed";
  std::vector<std::string> docs;
  auto tokens = fortune_tokens(0, 256, &docs);
  auto dir = fresh_dir("tokw");
  write_file(dir / "t.bin", as_bytes<uint16_t>(tokens));
  auto dm = build_data("name: token_file\npath: " + (dir / "t.bin").string() +
                       "\neot_token: 256\nmax_seq_len: 16\nval_fraction: 0.0\nshuffle: false\nbatch_size: 2\nnum_workers: 0\n");
  auto b = dm->train_loader()->make_batch(0, 0);
  EXPECT_EQ(b.at("tokens").size(1), 16);  // the first fortune is longer than 17 tokens: pieces of 16
  EXPECT_EQ(b.at("lengths")[0].item<int64_t>(), 16);
  auto w = build_data("name: token_file\npath: " + (dir / "t.bin").string() +
                      "\nmode: windows\nmax_seq_len: 32\nval_fraction: 0.1\nshuffle: false\nbatch_size: 2\nnum_workers: 0\n");
  const int64_t windows = (static_cast<int64_t>(tokens.size()) - 1) / 32;
  EXPECT_EQ(w->train_loader()->dataset().size() + w->val_loader()->dataset().size(), windows);
  EXPECT_EQ(w->train_loader()->dataset().describe(2), (dir / "t.bin").string() + ": window 2, tokens 64-96");
  auto wb = w->train_loader()->make_batch(0, 1);
  EXPECT_EQ(wb.at("tokens").sizes(), (std::vector<int64_t>{2, 32}));
  for (int k = 0; k < 32; ++k) {
    ASSERT_EQ(wb.at("tokens")[0][k].item<int64_t>(), tokens[64 + k]);  // window 2 starts at token 64
    ASSERT_EQ(wb.at("targets")[1][k].item<int64_t>(), tokens[96 + k + 1]);
  }
}

TEST(TokenFile, BadFilesNameTheFile) {
  auto dir = fresh_dir("tokbad");
  write_file(dir / "odd.bin", std::string(7, '\1'));
  EXPECT_EQ(error_of([&] { build_data("name: token_file\npath: " + (dir / "odd.bin").string() + "\n"); }),
            (dir / "odd.bin").string() + ": 7 bytes is not a multiple of the 2-byte token width (dtype uint16); truncated, or the wrong dtype");
  write_file(dir / "six.bin", std::string(6, '\1'));
  EXPECT_NE(error_of([&] { build_data("name: token_file\npath: " + (dir / "six.bin").string() + "\ndtype: uint32\n"); })
                .find("6 bytes is not a multiple of the 4-byte token width"),
            std::string::npos);
  write_file(dir / "big.bin", as_bytes<uint16_t>({1, 2, 3, 900, 5}));
  EXPECT_EQ(error_of([&] { build_data("name: token_file\npath: " + (dir / "big.bin").string() + "\nvocab_size: 512\neot_token: 5\n"); }),
            (dir / "big.bin").string() + ": token 900 at position 3 is not below vocab_size 512");
  write_file(dir / "empty.bin", "");
  EXPECT_EQ(error_of([&] { build_data("name: token_file\npath: " + (dir / "empty.bin").string() + "\n"); }),
            (dir / "empty.bin").string() + ": empty token file");
  EXPECT_THROW(build_data("name: token_file\npath: " + (dir / "none.bin").string() + "\n"), DataError);
}

TEST(IdxFile, HugeHeaderDimensionsAreReportedNotWrapped) {
  auto dir = fresh_dir("idx");
  // 4 dims of 0xFFFF0000 (product wraps past 2^64) and 4 dims of 2^16 (product 2^64 wraps to 0).
  for (auto [name, dim] : {std::pair{"wrap.idx", 0xFFFF0000u}, std::pair{"zero.idx", 0x10000u}}) {
    std::string h = {0, 0, 8, 4};
    for (int d = 0; d < 4; ++d) h += {char(dim >> 24), char((dim >> 16) & 255), char((dim >> 8) & 255), char(dim & 255)};
    write_file(dir / name, h + std::string(16, 'x'));
    const std::string path = (dir / name).string();  // C++17: a lambda cannot capture a structured binding
    const std::string msg = error_of([&] { data::read_idx_file(path); });
    EXPECT_EQ(msg.rfind(path + ": corrupt IDX header: dimensions", 0), 0u) << msg;
    EXPECT_NE(msg.find("overflow 64 bits (the file has 16 bytes of data)"), std::string::npos) << msg;
  }
  std::string h = {0, 0, 8, 1, 0, 0, 1, 0};  // 256 bytes promised, 3 present
  write_file(dir / "short.idx", h + "abc");
  EXPECT_EQ(error_of([&] { data::read_idx_file((dir / "short.idx").string()); }),
            (dir / "short.idx").string() + ": truncated IDX file: header dimensions 256 need 256 bytes, file has 3");
}

TEST(BadDataFiles, CorruptIdxAndCifarFilesExitTwoNamingTheFile) {
  auto root = fresh_dir("idx_cli");
  std::string h = {0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 28, 0, 0, 0, 28};
  for (const char* f : {"train-images-idx3-ubyte", "t10k-images-idx3-ubyte"}) write_file(root / f, h + "short");
  for (const char* f : {"train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"}) write_file(root / f, std::string{0, 0, 8, 1, 0, 0, 0, 2, 1, 2});
  auto cfg = fresh_dir("idx_cli_cfg") / "exp.yaml";
  write_file(cfg, "name: x\ntrainer:\n  max_steps: 1\n  device: cpu\nmodel:\n  name: mlp\ndata:\n  name: fashion_mnist\n  root: " + root.string() +
                      "\n  val_size: 0\n");
  auto r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --run-dir " + fresh_dir("idx_cli_run").string());
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err, "strobe: data error: " + (root / "train-images-idx3-ubyte").string() +
                       ": truncated IDX file: header dimensions 2 x 28 x 28 need 1568 bytes, file has 5\n");
  auto croot = fresh_dir("cifar_cli");
  for (int i = 1; i <= 5; ++i) write_file(croot / fmt::format("data_batch_{}.bin", i), std::string(3073, '\1'));
  write_file(croot / "test_batch.bin", std::string(3070, '\1'));
  write_file(cfg, "name: x\ntrainer:\n  max_steps: 1\n  device: cpu\nmodel:\n  name: mlp\n  in_features: 3072\ndata:\n  name: cifar10\n  root: " +
                      croot.string() + "\n  val_size: 0\n");
  r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --run-dir " + fresh_dir("cifar_cli_run").string());
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("strobe: data error: " + (croot / "test_batch.bin").string() + ": 3070 bytes is not a whole number"), std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace strobe

namespace strobe {
namespace {

TEST(ExampleConfigs, FaceDetectorCocoAndTheTokenFileLMsRun) {
  const std::string src = strobe::testing::source_path("");
  auto dir = coco_fixture("ex_coco");
  const std::string ann = (dir / "ann.json").string();
  auto r = run_cmd(strobe_bin() + " fit -c " + src + "/configs/face_detector_coco.yaml --run-dir " + fresh_dir("ex_coco_run").string() +
                   " --set data.annotations=" + ann + " --set data.images=" + dir.string() + " --set data.val_annotations=" + ann +
                   " --set data.val_images=" + dir.string() +
                   " --set data.image_size=64 --set model.image_size=64 --set data.max_boxes=4 --set model.max_boxes=4"
                   " --set model.hidden_dim=32 --set data.batch_size=3 --set data.num_workers=1 --set trainer.max_steps=2"
                   " --set trainer.device=cpu --set trainer.precision=32");
  EXPECT_EQ(r.code, 0) << r.err;
  if (!fs::exists("/usr/share/games/fortunes/fortunes")) GTEST_SKIP() << "fortunes is not installed";
  std::vector<std::string> docs;
  auto tdir = fresh_dir("ex_tok");
  write_file(tdir / "t.bin", as_bytes<uint16_t>(fortune_tokens(0, 256, &docs)));
  const std::string bin = (tdir / "t.bin").string();
  r = run_cmd(strobe_bin() + " fit -c " + src + "/configs/decoder_lm_token_file.yaml --run-dir " + fresh_dir("ex_tok_run").string() +
              " --set data.path=" + bin + " --set data.val_path=" + bin +
              " --set data.eot_token=256 --set data.vocab_size=320 --set model.vocab_size=320 --set data.max_seq_len=64"
              " --set model.max_seq_len=64 --set model.embed_dim=32 --set model.depth=1 --set model.num_heads=2 --set model.attention=math"
              " --set data.batch_size=4 --set data.num_workers=1 --set trainer.max_steps=2 --set trainer.limit_val_batches=1"
              " --set trainer.device=cpu --set trainer.precision=32 --set scheduler.warmup_steps=1");
  EXPECT_EQ(r.code, 0) << r.err;
  r = run_cmd(strobe_bin() + " fit -c " + src + "/configs/llama_token_file.yaml --run-dir " + fresh_dir("ex_llama_run").string() +
              " --set data.path=" + bin + " --set data.val_path=" + bin +
              " --set data.eot_token=256 --set data.vocab_size=320 --set model.vocab_size=320 --set data.max_seq_len=64"
              " --set model.max_seq_len=64 --set model.embed_dim=32 --set model.depth=1 --set model.num_heads=4"
              " --set model.num_kv_heads=2 --set model.attention=math --set data.batch_size=4 --set data.num_workers=1"
              " --set trainer.max_steps=2 --set trainer.limit_val_batches=1 --set trainer.device=cpu"
              " --set trainer.precision=32 --set scheduler.warmup_steps=1");
  EXPECT_EQ(r.code, 0) << r.err;
}

}  // namespace
}  // namespace strobe

namespace strobe {
namespace {

TEST(CocoBoxes, HorizontalFlipMirrorsImageAndBoxesTogether) {
  auto dir = coco_fixture("coco_flip");
  auto plain = build_data(coco_yaml(dir));
  auto flipping = build_data(coco_yaml(dir, "hflip: true\n"));
  auto p = plain->train_loader()->make_batch(0, 0);
  int flipped = 0, kept = 0;
  for (int64_t epoch = 0; epoch < 8; ++epoch) {
    auto f = flipping->train_loader()->make_batch(epoch, 0);
    const auto c = f.at("boxes")[2], c0 = p.at("boxes")[2];
    if (torch::equal(f.at("image")[2], p.at("image")[2])) {
      EXPECT_TRUE(torch::equal(c, c0));
      ++kept;
      continue;
    }
    ++flipped;
    EXPECT_TRUE(torch::equal(f.at("image")[2], p.at("image")[2].flip({2})));
    // Mirrored boxes: x1' = S - x2, x2' = S - x1, then sorted again by (y1, x1).
    auto m = c0.clone();
    m.select(1, 0).copy_(64 - c0.select(1, 2));
    m.select(1, 2).copy_(64 - c0.select(1, 0));
    auto key = [](const torch::Tensor& b) {
      std::vector<std::array<float, 4>> rows;
      for (int i = 0; i < b.size(0); ++i) rows.push_back({b[i][0].item<float>(), b[i][1].item<float>(), b[i][2].item<float>(), b[i][3].item<float>()});
      std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return std::tie(a[1], a[0]) < std::tie(b[1], b[0]); });
      return rows;
    };
    auto got = key(c), want = key(m);
    for (size_t i = 0; i < got.size(); ++i)
      for (int k = 0; k < 4; ++k) EXPECT_NEAR(got[i][k], want[i][k], 1e-4);
  }
  EXPECT_GT(flipped, 0);
  EXPECT_GT(kept, 0);
}

}  // namespace
}  // namespace strobe
