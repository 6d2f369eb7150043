// image_folder: listing order, decoding (JPEG/PNG, grey/colour, DCT scaling), transforms that are
// pure functions of (seed, epoch, index), training through `strobe fit` with an exact resume, and bad
// files: exit 2 naming the file, or counted and left out under on_bad_sample: skip.
#include <gtest/gtest.h>

#include <algorithm>
#include <torch/torch.h>

#include "data/image_codec.h"
#include "data/image_folder.h"
#include "data/image_transforms.h"
#include "strobe/data/data_error.h"
#include "strobe/data/dataset.h"
#include <nlohmann/json.hpp>

#include "tests/data/real_data_util.h"
#include "tests/source_path.h"

namespace strobe {
namespace {

namespace fs = std::filesystem;
using namespace strobe::testing;
using data::BadSampleLog;
using data::DataError;
using data::OnBadSample;

std::string folder_yaml(const fs::path& root, const std::string& extra = "") {
  return "name: image_folder\nroot: " + root.string() + "\nimage_size: 28\nchannels: 1\nnum_workers: 0\n" + extra;
}

// A tiny gradient image, encoded.
std::string small_jpeg() {
  std::vector<uint8_t> px(16 * 16 * 3);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i * 7);
  return data::encode_jpeg(px.data(), 16, 16, 3, 90);
}

TEST(ImageFolder, ClassesAreSortedNamesAndFilesSortedPerFolderLikeTorchvision) {
  auto root = fresh_dir("if_list");
  for (const char* c : {"b", "a", "C", "a b"}) fs::create_directories(root / c);
  fs::create_directories(root / "a" / "sub");
  for (const char* f : {"b/2.jpg", "b/10.jpg", "a/z.png", "a/sub/a.JPEG", "C/x.jpg", "a b/y.jpg"}) write_file(root / f, small_jpeg());
  write_file(root / "stray.jpg", small_jpeg());  // files directly under root are not samples
  BadSampleLog log("t", OnBadSample::Error);
  auto l = data::list_image_folder(root.string(), log);
  EXPECT_EQ(l.classes, (std::vector<std::string>{"C", "a", "a b", "b"}));  // byte order, as Python's sorted()
  std::vector<std::pair<std::string, int64_t>> want = {
      {(root / "C/x.jpg").string(), 0}, {(root / "a/z.png").string(), 1}, {(root / "a/sub/a.JPEG").string(), 1},
      {(root / "a b/y.jpg").string(), 2}, {(root / "b/10.jpg").string(), 3}, {(root / "b/2.jpg").string(), 3}};
  EXPECT_EQ(l.samples, want);
}

TEST(ImageFolder, UnknownExtensionAndEmptyClassAreErrorsOrCountedSkips) {
  auto root = fresh_dir("if_bad_list");
  fs::create_directories(root / "cat");
  fs::create_directories(root / "dog");
  fs::create_directories(root / "empty");
  write_file(root / "cat/1.jpg", small_jpeg());
  write_file(root / "dog/1.jpg", small_jpeg());
  write_file(root / "dog/notes.txt", "hello");
  try {
    build_data(folder_yaml(root));
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find((root / "dog/notes.txt").string() + ": unknown extension"), std::string::npos) << e.what();
  }
  fs::remove(root / "dog/notes.txt");
  try {
    build_data(folder_yaml(root));
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find((root / "empty").string() + ": class folder 'empty' holds no image"), std::string::npos) << e.what();
  }
  write_file(root / "dog/notes.txt", "hello");
  BadSampleLog log("t", OnBadSample::Skip);
  auto l = data::list_image_folder(root.string(), log);
  EXPECT_EQ(log.count(), 2);  // notes.txt and the empty class
  EXPECT_EQ(l.classes.size(), 3u);  // the empty class keeps its index
  EXPECT_EQ(l.samples.size(), 2u);
}

TEST(ImageCodec, DecodesEncodedPixelsExactlyAndDownscalesJpegsInTheDctDomain) {
  // PNG is lossless: grey and RGB round-trip exactly, and to the other channel count as PIL converts.
  std::vector<uint8_t> rgb(40 * 30 * 3);
  for (size_t i = 0; i < rgb.size(); ++i) rgb[i] = static_cast<uint8_t>((i * 37) % 251);
  auto img = data::decode_image(data::encode_png(rgb.data(), 40, 30, 3), "x.png", 3);
  EXPECT_EQ(img.width, 40);
  EXPECT_EQ(img.height, 30);
  EXPECT_EQ(img.pixels, rgb);
  auto gray = data::decode_image(data::encode_png(rgb.data(), 40, 30, 3), "x.png", 1);
  for (int p = 0; p < 40 * 30; ++p) {
    const double l = 0.299 * rgb[3 * p] + 0.587 * rgb[3 * p + 1] + 0.114 * rgb[3 * p + 2];
    ASSERT_NEAR(gray.pixels[p], l, 1.0) << p;
  }
  std::vector<uint8_t> g(rgb.begin(), rgb.begin() + 1200);
  auto g3 = data::decode_image(data::encode_png(g.data(), 40, 30, 1), "g.png", 3);
  for (int p = 0; p < 1200; ++p) ASSERT_TRUE(g3.pixels[3 * p] == g[p] && g3.pixels[3 * p + 2] == g[p]);

  // JPEG: a smooth image survives quality 95 closely; DCT scaling picks the strongest power of two.
  std::vector<uint8_t> smooth(256 * 192 * 3);
  for (int y = 0; y < 192; ++y)
    for (int x = 0; x < 256; ++x)
      for (int c = 0; c < 3; ++c) smooth[(y * 256 + x) * 3 + c] = static_cast<uint8_t>((x + 2 * y + 40 * c) / 3);
  std::string jpg = data::encode_jpeg(smooth.data(), 256, 192, 3, 95);
  auto full = data::decode_image(jpg, "s.jpg", 3);
  ASSERT_EQ(full.pixels.size(), smooth.size());
  double err = 0;
  for (size_t i = 0; i < smooth.size(); ++i) err = std::max(err, std::abs(double(full.pixels[i]) - smooth[i]));
  EXPECT_LE(err, 6);
  for (auto [min_scale, w, h] : {std::tuple{1.0, 256, 192}, {0.6, 256, 192}, {0.5, 128, 96}, {0.3, 128, 96}, {0.25, 64, 48}, {0.01, 32, 24}}) {
    auto s = data::decode_image(jpg, "s.jpg", 3, min_scale);
    EXPECT_EQ(s.width, w) << min_scale;
    EXPECT_EQ(s.height, h) << min_scale;
    EXPECT_EQ(s.full_width, 256);
  }
  // Resampling a box from the 1/4-scale decode agrees with resampling it from the full decode.
  data::CropBox box{32, 16, 160, 160};
  const float mean[3] = {0, 0, 0}, std[3] = {1, 1, 1};
  auto a = torch::empty({3, 32, 32}), b = torch::empty({3, 32, 32});
  data::resample_to_float(full, box, 32, 32, false, mean, std, a.data_ptr<float>());
  data::resample_to_float(data::decode_image(jpg, "s.jpg", 3, data::min_decode_scale(box, 32, 32)), box, 32, 32, false, mean, std,
                          b.data_ptr<float>());
  EXPECT_LT((a - b).abs().max().item<float>() * 255, 4.0);
}

// A crop decoded as a region (only where its resampling reads) resamples to the same floats, bit for
// bit, as the whole decode: colour 4:2:0 (fancy upsampling, whose edges a region shares with the
// image only where they are the image's), 4:4:4 and grey files, decoded to 3 and 1 channels, at every
// DCT scale; boxes at the image's edges, tiny and whole. A truncated file fails whatever the region.
TEST(ImageCodec, ARegionDecodeResamplesBitForBitAsTheWholeDecode) {
  const int W = 333, H = 251;
  std::vector<uint8_t> px(W * H * 3), gray(W * H);
  uint32_t st = 12345;
  auto next = [&] { return st = st * 1664525u + 1013904223u; };
  for (int y = 0; y < H; ++y)
    for (int x = 0; x < W; ++x) {
      for (int c = 0; c < 3; ++c)
        px[(y * W + x) * 3 + c] = static_cast<uint8_t>(std::clamp<int>((x * (c + 1) + y * (3 - c)) % 256 + int(next() >> 26) - 32, 0, 255));
      gray[y * W + x] = px[(y * W + x) * 3 + 1];
    }
  const std::vector<std::pair<std::string, std::string>> files = {{"420", data::encode_jpeg(px.data(), W, H, 3, 90, true)},
                                                                  {"444", data::encode_jpeg(px.data(), W, H, 3, 90, false)},
                                                                  {"grey", data::encode_jpeg(gray.data(), W, H, 1, 90)}};
  auto gen = data::sample_generator(5, 0, 0);
  data::SampleRng rng(gen, 0);
  const float mean[3] = {0, 0, 0}, stdv[3] = {1, 1, 1};
  int partial = 0, cases = 0;
  for (const auto& [kind, jpg] : files)
    for (int channels : {3, 1})
      for (int t = 0; t < 48; ++t) {
        const int out = t % 3 == 0 ? 24 : 64;
        data::CropBox box = t == 0   ? data::whole_image_box(W, H)
                            : t == 1 ? data::CropBox{0, 0, 40, 30}
                            : t == 2 ? data::CropBox{W - 37.0, H - 29.0, 37, 29}
                            : t == 3 ? data::CropBox{150, 100, 3, 2}
                            : t == 4 ? data::resize_center_crop_box(W, H, 73, 64)
                                     : data::random_resized_crop_box(W, H, 0.02, 1.0, 0.5, 2.0, rng);
        for (double scale : {1.0, data::min_decode_scale(box, out, out)}) {
          data::Image whole, part;
          data::decode_image_into(jpg, "x.jpg", channels, scale, whole);
          data::decode_image_into(jpg, "x.jpg", channels, scale, part, data::DecodeRegion{box.x, box.y, box.w, box.h, out, out});
          ASSERT_EQ(whole.x0, 0);
          ASSERT_EQ(part.scaled_width, whole.width);
          ASSERT_EQ(part.scaled_height, whole.height);
          partial += part.width * part.height < whole.width * whole.height;
          ++cases;
          auto a = torch::empty({channels, out, out}), b = torch::empty({channels, out, out});
          data::resample_to_float(whole, box, out, out, t % 2 == 1, mean, stdv, a.data_ptr<float>());
          data::resample_to_float(part, box, out, out, t % 2 == 1, mean, stdv, b.data_ptr<float>());
          ASSERT_TRUE(torch::equal(a, b)) << kind << " to " << channels << " channels, box " << box.x << "," << box.y << " " << box.w
                                          << "x" << box.h << " -> " << out << ", scale " << scale << ", region at " << part.x0 << ","
                                          << part.y0 << " " << part.width << "x" << part.height << ": max difference "
                                          << (a - b).abs().max().item<float>() * 255;
        }
      }
  EXPECT_GT(partial, cases / 2);  // most decodes held only a part of the image
  const std::string& jpg = files[0].second;
  data::Image img;
  EXPECT_THROW(data::decode_image_into(jpg.substr(0, jpg.size() * 3 / 4), "t.jpg", 3, 1.0, img, data::DecodeRegion{0, 0, 40, 30, 32, 32}),
               DataError);
}

TEST(ImageCodec, TruncatedOrForeignFilesAreDataErrorsNamingTheFile) {
  std::vector<uint8_t> px(64 * 64 * 3);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 2654435761u) >> 24);  // busy: long scan data
  std::string jpg = data::encode_jpeg(px.data(), 64, 64, 3, 90), png = data::encode_png(px.data(), 64, 64, 3);
  auto msg = [](const std::string& bytes, const std::string& name) {
    try {
      data::decode_image(bytes, name, 3);
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(msg(jpg.substr(0, jpg.size() / 2), "/d/t.jpg").rfind("/d/t.jpg: truncated or corrupt JPEG", 0), 0u) << msg(jpg.substr(0, jpg.size() / 2), "/d/t.jpg");
  EXPECT_EQ(msg(jpg.substr(0, 200), "/d/h.jpg").rfind("/d/h.jpg: truncated or corrupt JPEG", 0), 0u) << msg(jpg.substr(0, 200), "/d/h.jpg");
  EXPECT_EQ(msg(png.substr(0, png.size() - 20), "/d/t.png").rfind("/d/t.png: truncated or corrupt PNG", 0), 0u);
  EXPECT_EQ(msg(png.substr(0, png.size() / 2), "/d/u.png").rfind("/d/u.png: truncated or corrupt PNG", 0), 0u);
  EXPECT_EQ(msg("GIF89a....", "/d/x.jpg"), "/d/x.jpg: not a JPEG or PNG image (unrecognised content)");
  EXPECT_EQ(msg("", "/d/e.png"), "/d/e.png: empty file (not a JPEG or PNG image)");
  EXPECT_THROW(data::read_file_bytes("/nonexistent/x.jpg"), DataError);
}

TEST(ImageTransforms, BoxesFollowTorchvision) {
  // Resize(256) + CenterCrop(224) on 500x375: resized 341x256, crop at left round(58.5)=58 (banker's
  // rounding in Python gives 58 too), top 16.
  auto b = data::resize_center_crop_box(500, 375, 256, 224);
  EXPECT_NEAR(b.x, 58 * 500.0 / 341, 1e-9);
  EXPECT_NEAR(b.y, 16 * 375.0 / 256, 1e-9);
  EXPECT_NEAR(b.w, 224 * 500.0 / 341, 1e-9);
  EXPECT_NEAR(b.h, 224 * 375.0 / 256, 1e-9);
  // RandomResizedCrop boxes stay inside the image, with area and ratio in range.
  auto gen = data::sample_generator(1, 0, 0);
  data::SampleRng rng(gen, 0);
  for (int i = 0; i < 1000; ++i) {
    auto c = data::random_resized_crop_box(500, 375, 0.08, 1.0, 0.75, 4.0 / 3, rng);
    ASSERT_TRUE(c.x >= 0 && c.y >= 0 && c.x + c.w <= 500 && c.y + c.h <= 375);
    const double area = c.w * c.h / (500.0 * 375);
    ASSERT_TRUE(area >= 0.079 && area <= 1.0) << area;
  }
  // An identity resample (whole image, same size) returns the pixels exactly.
  data::Image img;
  img.width = img.full_width = 5;
  img.height = img.full_height = 4;
  img.channels = 1;
  for (int i = 0; i < 20; ++i) img.pixels.push_back(static_cast<uint8_t>(i * 13));
  std::vector<uint8_t> out(20);
  data::resample_to_u8(img, data::whole_image_box(5, 4), 5, 4, out.data());
  EXPECT_EQ(out, img.pixels);
}

TEST(ImageFolder, SamplesArePureFunctionsOfSeedEpochAndIndex) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  auto root = fashion_folder("if_det", 5);
  auto dm = build_data(folder_yaml(root, "val_root: " + root.string() + "\nbatch_size: 8\nresize_size: 28\n"), 3);
  auto loader = dm->train_loader();
  ASSERT_EQ(loader->dataset().size(), 50);
  auto b1 = loader->make_batch(0, 1), b2 = loader->make_batch(0, 1), b3 = loader->make_batch(1, 1);
  EXPECT_EQ(b1.at("image").sizes(), (std::vector<int64_t>{8, 1, 28, 28}));
  EXPECT_EQ(b1.at("label").sizes(), (std::vector<int64_t>{8}));
  EXPECT_TRUE(torch::equal(b1.at("image"), b2.at("image")));
  EXPECT_FALSE(torch::equal(b1.at("image"), b3.at("image")));  // another epoch: other crops and order
  // Sample 7 of epoch 0 directly, twice, with fresh generators: identical; another index differs.
  auto g1 = data::sample_generator(3, 0, 7), g2 = data::sample_generator(3, 0, 7);
  auto s1 = loader->dataset().get(7, g1), s2 = loader->dataset().get(7, g2);
  EXPECT_TRUE(torch::equal(s1.at("image"), s2.at("image")));
  EXPECT_EQ(s1.at("image").sizes(), (std::vector<int64_t>{1, 28, 28}));
  // Eval: resize + center crop of a 28x28 image to 28 is the image itself, normalized.
  auto val = dm->val_loader()->make_batch(0, 0);
  // Batches leave the loader as uint8; the data module normalizes them after the device transfer.
  EXPECT_EQ(val.at("image").scalar_type(), torch::kUInt8);
  val = dm->on_after_batch_transfer(dm->transfer_batch_to_device(val, torch::kCPU, 0), 0);
  EXPECT_EQ(val.at("image").scalar_type(), torch::kFloat32);
  const auto listing = data::list_image_folder(root.string(), *std::make_shared<BadSampleLog>("t", OnBadSample::Error));
  const auto& [path0, label0] = listing.samples[0];
  auto img = data::decode_image(data::read_file_bytes(path0), path0, 1);
  auto want = (torch::from_blob(img.pixels.data(), {1, 28, 28}, torch::kUInt8).to(torch::kFloat32) / 255 - 0.449) / 0.226;
  EXPECT_LT((val.at("image")[0] - want).abs().max().item<float>(), 1e-5);
  EXPECT_EQ(val.at("label")[0].item<int64_t>(), label0);
  EXPECT_EQ(listing.classes.front(), "Ankle boot");  // sorted names, not Fashion-MNIST's label order
}

TEST(ImageFolder, FitThroughTheCliAndResumeExactly) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  auto root = fashion_folder("if_fit", 8);
  auto cfg = fresh_dir("if_fit_cfg") / "exp.yaml";
  write_file(cfg, R"(name: image_folder_fit
seed: 5
trainer:
  max_steps: 12
  max_epochs: 10
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  limit_val_batches: 2
  enable_progress_bar: false
  device: cpu
model:
  name: mlp
  in_features: 784
  hidden: [32]
  num_classes: 10
data:
  name: image_folder
  root: )" + root.string() + R"(
  val_root: )" + root.string() + R"(
  image_size: 28
  resize_size: 32
  channels: 1
  batch_size: 16
  num_workers: 2
optimizer:
  name: adamw
  lr: 0.01
callbacks:
  - name: model_checkpoint
    every_n_steps: 4
    save_top_k: -1
)");
  auto straight = fresh_dir("if_fit_a"), resumed = fresh_dir("if_fit_b");
  auto r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --run-dir " + straight.string());
  ASSERT_EQ(r.code, 0) << r.err;
  const auto ckpt = (straight / "checkpoints" / "step=4.ckpt").string();
  ASSERT_TRUE(fs::exists(ckpt)) << r.out << r.err;
  r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --run-dir " + resumed.string() + " --ckpt " + ckpt);
  ASSERT_EQ(r.code, 0) << r.err;
  auto a = csv_column((straight / "metrics.csv").string(), "train/loss"), b = csv_column((resumed / "metrics.csv").string(), "train/loss");
  ASSERT_EQ(a.size(), 12u);
  for (int64_t step = 5; step <= 12; ++step) {
    ASSERT_TRUE(b.count(step)) << "step " << step;
    EXPECT_EQ(a[step], b[step]) << "train/loss at step " << step;
  }
  auto pa = model_tensors_of((straight / "checkpoints/last.ckpt").string()), pb = model_tensors_of((resumed / "checkpoints/last.ckpt").string());
  ASSERT_EQ(pa.size(), pb.size());
  for (auto& [k, v] : pa) EXPECT_TRUE(torch::equal(v, pb.at(k))) << k;
  EXPECT_NE(a[1], a[12]);
}

TEST(ImageFolder, CorruptImageExitsTwoNamingTheFileOrIsSkippedAndCounted) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  auto root = fashion_folder("if_corrupt", 2);
  const auto bad = root / "Bag" / "img_000.jpg";
  std::string bytes = slurp(bad.string());
  write_file(bad, bytes.substr(0, bytes.size() / 2));
  auto cfg = fresh_dir("if_corrupt_cfg") / "exp.yaml";
  write_file(cfg, "name: corrupt\ntrainer:\n  max_steps: 3\n  enable_progress_bar: false\n  device: cpu\n  num_sanity_val_steps: 0\n"
                  "model:\n  name: mlp\n  in_features: 784\n  hidden: [8]\n  num_classes: 10\n"
                  "data:\n  name: image_folder\n  root: " + root.string() + "\n  image_size: 28\n  channels: 1\n  batch_size: 4\n");
  auto r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --run-dir " + fresh_dir("if_corrupt_a").string());
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("strobe: data error: " + bad.string() + ": truncated or corrupt JPEG"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("terminate"), std::string::npos);
  r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --run-dir " + fresh_dir("if_corrupt_b").string() +
              " --set data.on_bad_sample=skip --set trainer.max_steps=10");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("skipped " + bad.string() + ": truncated or corrupt JPEG"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(1 bad item skipped so far"), std::string::npos) << r.err;
  // Listing problems exit 2 too, before training starts.
  write_file(root / "Bag" / "readme.txt", "x");
  r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --run-dir " + fresh_dir("if_corrupt_c").string());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("strobe: data error: " + (root / "Bag" / "readme.txt").string() + ": unknown extension"), std::string::npos) << r.err;
}

// A real cause for on_exception_checkpoint: read in order, the 7th image is corrupt, so the batch of
// step 4 (images 7 and 8) fails to load: the run stops with the data error and on_exception.ckpt
// holds step 3. With the file repaired, resuming it ends where an uninterrupted run ends. A corrupt
// first image stops the run before any training batch: nothing is saved.
TEST(ImageFolder, ACorruptImageStopsTheRunAndItsExceptionCheckpointResumesExactly) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  auto root = fashion_folder("if_exc", 1);
  const auto listing = data::list_image_folder(root.string(), *std::make_shared<BadSampleLog>("t", OnBadSample::Error));
  ASSERT_EQ(listing.samples.size(), 10u);
  const fs::path seventh = listing.samples[6].first, first = listing.samples[0].first;
  const std::string good = slurp(seventh.string()), good_first = slurp(first.string());
  auto cfg = fresh_dir("if_exc_cfg") / "exp.yaml";
  write_file(cfg, "name: exc\nseed: 2\ntrainer:\n  max_steps: 5\n  log_every_n_steps: 1\n  enable_progress_bar: false\n"
                  "  device: cpu\n  num_sanity_val_steps: 0\nmodel:\n  name: mlp\n  in_features: 784\n  hidden: [8]\n  dropout: 0.3\n"
                  "  num_classes: 10\ndata:\n  name: image_folder\n  root: " + root.string() +
                  "\n  image_size: 28\n  channels: 1\n  batch_size: 2\n  shuffle: false\n  num_workers: 2\n"
                  "optimizer:\n  name: adamw\n  lr: 0.01\ncallbacks:\n  - name: on_exception_checkpoint\n");
  auto full = fresh_dir("if_exc_full"), failed = fresh_dir("if_exc_failed");
  auto r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --run-dir " + full.string());
  ASSERT_EQ(r.code, 0) << r.err;
  write_file(seventh, good.substr(0, good.size() / 2));
  r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --run-dir " + failed.string());
  EXPECT_EQ(r.code, 2) << r.err;
  const auto saved = (failed / "checkpoints" / "on_exception.ckpt").string();
  EXPECT_NE(r.err.find("strobe: training stopped by an error; saved " + saved + " at step 3 (the last completed step)"),
            std::string::npos) << r.err;
  EXPECT_NE(r.err.find("strobe: data error: " + seventh.string() + ": truncated or corrupt JPEG"), std::string::npos) << r.err;
  ASSERT_TRUE(fs::exists(saved)) << r.err;
  EXPECT_EQ(nlohmann::json::parse(checkpoint::load_checkpoint_file(saved).blob("meta"))["global_step"], 3);
  write_file(seventh, good);
  r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --ckpt " + saved);
  ASSERT_EQ(r.code, 0) << r.err;
  auto pa = model_tensors_of((full / "checkpoints/last.ckpt").string()), pb = model_tensors_of((failed / "checkpoints/last.ckpt").string());
  ASSERT_EQ(pa.size(), pb.size());
  for (auto& [k, v] : pa) EXPECT_TRUE(torch::equal(v, pb.at(k))) << k;
  EXPECT_EQ(csv_column((full / "metrics.csv").string(), "train/loss"), csv_column((failed / "metrics.csv").string(), "train/loss"));

  write_file(first, good_first.substr(0, good_first.size() / 2));
  auto early = fresh_dir("if_exc_early");
  r = run_cmd(strobe_bin() + " fit -c " + cfg.string() + " --run-dir " + early.string());
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(fs::exists(early / "checkpoints" / "on_exception.ckpt")) << r.err;
  EXPECT_EQ(r.err.find("saved"), std::string::npos) << r.err;
  write_file(first, good_first);
}

TEST(ImageFolder, EveryBadSampleInABatchIsAnErrorEvenWhenSkipping) {
  auto root = fresh_dir("if_allbad");
  fs::create_directories(root / "a");
  write_file(root / "a" / "1.jpg", "not a jpeg");
  auto dm = build_data(folder_yaml(root, "on_bad_sample: skip\n"));
  try {
    dm->train_loader()->make_batch(0, 0);
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("every one of its 1 samples was bad"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace strobe

namespace strobe {
namespace {

// The example config trains as written, only shrunk and pointed at a fixture.
TEST(ExampleConfigs, Resnet50ImageFolderRuns) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  auto root = fashion_folder("ex_rn50", 2);
  const std::string src = strobe::testing::source_path("");
  auto r = run_cmd(strobe_bin() + " fit -c " + src + "/configs/resnet50_image_folder.yaml --run-dir " + fresh_dir("ex_rn50_run").string() +
                   " --set data.root=" + root.string() + " --set data.val_root=" + root.string() +
                   " --set model.width=4 --set model.num_classes=10 --set data.image_size=32 --set data.resize_size=36"
                   " --set data.batch_size=8 --set data.num_workers=2 --set trainer.max_steps=2 --set trainer.limit_val_batches=1"
                   " --set trainer.device=cpu --set trainer.precision=32 --set scheduler.warmup_steps=1");
  EXPECT_EQ(r.code, 0) << r.err;
}

}  // namespace
}  // namespace strobe
