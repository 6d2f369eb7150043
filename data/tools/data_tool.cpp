// strobe_data_tool: fixtures and probes for the data tests and the loader benchmark.
//   fashion-folder OUT PER_CLASS   an image folder from Fashion-MNIST's training images, encoded with
//                                  our libjpeg-turbo/libpng encoders: class folders named after the
//                                  classes (sorted order differs from label order); per class, files
//                                  cycle through grey JPEG, grey PNG, colour JPEG (three images as R,
//                                  G, B, 4:2:0), colour PNG, and a 4x-upscaled colour JPEG (112x112).
//   photo-folder OUT N CLASSES SEED [GRAIN]  ImageNet-like JPEGs for the benchmark: sizes around 500x375
//                                  (each side uniform in [0.7, 1.3] x), colour gradients, ellipses,
//                                  a wave and Gaussian grain (standard deviation GRAIN, default 6:
//                                  ~43 KB a file; 26: ~110 KB, ImageNet's mean), quality 90, 4:2:0 (no
//                                  dataset needed).
//   list ROOT                      "class<TAB>index<TAB>name" lines, then "sample<TAB>label<TAB>path".
//   decode CHANNELS MIN_SCALE OUT_DIR FILE...  each file's raw height x width x channels bytes to
//                                  OUT_DIR/<k>.raw (k = its position); prints "W H C" per file.
//   pack-stats FILE EOT MAX_SEQ_LEN BATCH  a uint16 token file's documents (token_file's documents
//                                  mode) laid out for one epoch by the collates and by data.packing:
//                                  best_fit, and by greedy rows that crop what does not fit (the
//                                  alternative packing it is measured against): batches, padding and
//                                  tokens discarded (docs/PERFORMANCE.md, "Packing").
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include <fmt/format.h>
#include <torch/torch.h>

#include "data/idx_file.h"
#include "data/image_codec.h"
#include "data/image_folder.h"
#include "strobe/config/config.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/data_error.h"
#include "strobe/data/packing.h"
#include "strobe/data/sampler.h"

namespace fs = std::filesystem;
using namespace strobe::data;

namespace {

const char* kFashionClasses[10] = {"T-shirt_top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};

void write(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error(fmt::format("{}: cannot write", p.string()));
}

torch::Tensor fashion_images(torch::Tensor* labels) {
  const std::string root = "/usr/share/datasets/fashion-mnist";
  *labels = read_idx_file(root + "/train-labels-idx1-ubyte.gz");
  return read_idx_file(root + "/train-images-idx3-ubyte.gz");
}

int fashion_folder(const fs::path& out, int per_class) {
  torch::Tensor labels;
  auto images = fashion_images(&labels);
  const auto* lbl = labels.data_ptr<uint8_t>();
  const auto* px = images.data_ptr<uint8_t>();
  std::vector<std::vector<int64_t>> by_class(10);
  for (int64_t i = 0; i < labels.size(0); ++i) by_class[lbl[i]].push_back(i);
  for (int c = 0; c < 10; ++c) {
    fs::create_directories(out / kFashionClasses[c]);
    for (int k = 0; k < per_class; ++k) {
      const auto& idx = by_class[c];
      const uint8_t* a = px + idx.at(3 * k) * 784;
      const uint8_t* b = px + idx.at(3 * k + 1) * 784;
      const uint8_t* d = px + idx.at(3 * k + 2) * 784;
      std::vector<uint8_t> rgb(784 * 3);
      for (int p = 0; p < 784; ++p) rgb[3 * p] = a[p], rgb[3 * p + 1] = b[p], rgb[3 * p + 2] = d[p];
      const fs::path base = out / kFashionClasses[c] / fmt::format("img_{:03d}", k);
      switch (k % 5) {
        case 0: write(base.string() + ".jpg", encode_jpeg(a, 28, 28, 1, 90)); break;
        case 1: write(base.string() + ".png", encode_png(a, 28, 28, 1)); break;
        case 2: write(base.string() + ".jpeg", encode_jpeg(rgb.data(), 28, 28, 3, 85, true)); break;
        case 3: write(base.string() + ".PNG", encode_png(rgb.data(), 28, 28, 3)); break;
        default: {
          std::vector<uint8_t> big(112 * 112 * 3);
          for (int y = 0; y < 112; ++y)
            for (int x = 0; x < 112; ++x)
              for (int ch = 0; ch < 3; ++ch) big[(y * 112 + x) * 3 + ch] = rgb[((y / 4) * 28 + x / 4) * 3 + ch];
          write(base.string() + ".jpg", encode_jpeg(big.data(), 112, 112, 3, 92, true));
        }
      }
    }
  }
  return 0;
}

int photo_folder(const fs::path& out, int n, int classes, uint64_t seed, double grain_sd = 6.0) {
  // Procedural (no dataset needed, so the GPU machine makes the same files): a colour gradient, a
  // few soft-edged ellipses, a diagonal wave and Gaussian grain, which JPEG-compresses like a photo.
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::normal_distribution<double> grain(0.0, grain_sd);
  for (int c = 0; c < classes; ++c) fs::create_directories(out / fmt::format("n{:08d}", c));
  for (int i = 0; i < n; ++i) {
    const int w = static_cast<int>(500 * (0.7 + 0.6 * u(rng))), h = static_cast<int>(375 * (0.7 + 0.6 * u(rng)));
    double base[3], gx[3], gy[3];
    for (int ch = 0; ch < 3; ++ch) base[ch] = 40 + 150 * u(rng), gx[ch] = (u(rng) - 0.5) * 120 / w, gy[ch] = (u(rng) - 0.5) * 120 / h;
    struct Blob {
      double cx, cy, rx, ry, col[3];
    };
    std::vector<Blob> blobs(3 + static_cast<int>(u(rng) * 4));
    for (auto& b : blobs) b = {u(rng) * w, u(rng) * h, 20 + u(rng) * w / 3, 20 + u(rng) * h / 3, {u(rng) * 255, u(rng) * 255, u(rng) * 255}};
    std::vector<uint8_t> img(static_cast<size_t>(w) * h * 3);
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x) {
        double v[3];
        const double wave = 12 * std::sin(x * 0.05 + y * 0.03 + i);
        for (int ch = 0; ch < 3; ++ch) v[ch] = base[ch] + gx[ch] * x + gy[ch] * y + wave;
        for (const auto& b : blobs) {
          const double dx = (x - b.cx) / b.rx, dy = (y - b.cy) / b.ry, d = dx * dx + dy * dy;
          const double a = std::clamp((1.2 - d) * 3, 0.0, 1.0);
          if (a > 0)
            for (int ch = 0; ch < 3; ++ch) v[ch] = v[ch] * (1 - a) + b.col[ch] * a;
        }
        for (int ch = 0; ch < 3; ++ch) img[(static_cast<size_t>(y) * w + x) * 3 + ch] = static_cast<uint8_t>(std::clamp(v[ch] + grain(rng), 0.0, 255.0));
      }
    write(out / fmt::format("n{:08d}", i % classes) / fmt::format("img_{:06d}_{}.JPEG", i, seed), encode_jpeg(img.data(), w, h, 3, 90, true));
  }
  return 0;
}

int list(const std::string& root) {
  BadSampleLog log("list", OnBadSample::Error);
  auto l = list_image_folder(root, log);
  for (size_t c = 0; c < l.classes.size(); ++c) fmt::print("class\t{}\t{}\n", c, l.classes[c]);
  for (const auto& [path, label] : l.samples) fmt::print("sample\t{}\t{}\n", label, path);
  return 0;
}

int decode(int channels, double min_scale, const fs::path& out_dir, const std::vector<std::string>& files) {
  for (size_t k = 0; k < files.size(); ++k) {
    auto img = decode_image(read_file_bytes(files[k]), files[k], channels, min_scale);
    write(out_dir / fmt::format("{}.raw", k), std::string(reinterpret_cast<const char*>(img.pixels.data()), img.pixels.size()));
    fmt::print("{} {} {}\n", img.width, img.height, img.channels);
  }
  return 0;
}

int pack_stats(const std::string& file, int64_t eot, int64_t max_len, int64_t batch) {
  const std::string yaml = fmt::format(
      "name: token_file\npath: {}\ndtype: uint16\neot_token: {}\nmax_seq_len: {}\nval_fraction: 0.0\nbatch_size: {}\n"
      "num_workers: 0\ncollate: pack\n",
      file, eot, max_len, batch);
  auto doc = strobe::config::Document::load_string(yaml, "pack-stats.yaml");
  auto section = doc.root();
  strobe::DataContext ctx;
  ctx.seed = 1;
  auto dm = strobe::data_registry().create(section, "", ctx);
  const Dataset& d = dm->train_loader()->dataset();
  const int64_t n = d.size();
  std::vector<int64_t> length(static_cast<size_t>(n));
  int64_t tokens = 0, longest = 0;
  for (int64_t i = 0; i < n; ++i) length[i] = d.sample_length(i), tokens += length[i], longest = std::max(longest, length[i]);
  SamplerOptions so;
  so.seed = 1;
  const auto order = DistributedSampler(n, so).indices(0);
  const double cap = static_cast<double>(batch * max_len);
  auto pct = [](double part, double whole) { return 100.0 * part / whole; };
  fmt::print("{}: {} samples (documents, and pieces of {} tokens of the longer ones), {} tokens, mean {:.1f}, longest {}; "
             "rows of {}, batches of {}\n",
             file, n, max_len, tokens, static_cast<double>(tokens) / static_cast<double>(n), longest, max_len, batch);
  fmt::print("| layout | batches an epoch | tokens a batch (mean) | of batch x max_seq_len | padding | tokens discarded | plan ms |\n");
  fmt::print("| --- | --- | --- | --- | --- | --- | --- |\n");
  const int64_t doc_batches = (n + batch - 1) / batch;
  fmt::print("| pack (batch_size documents) | {} | {:.0f} | {:.1f}% | 0 | 0 | |\n", doc_batches,
             static_cast<double>(tokens) / static_cast<double>(doc_batches),
             pct(static_cast<double>(tokens), static_cast<double>(doc_batches) * cap));
  fmt::print("| pad_to_max (batch_size documents) | {} | {:.0f} | 100% | {:.1f}% | 0 | |\n", doc_batches, cap,
             pct(static_cast<double>(doc_batches) * cap - static_cast<double>(tokens), static_cast<double>(doc_batches) * cap));
  // Greedy rows in the epoch's order, cropping: a sample that does not fit the row's free space fills
  // it and its rest is discarded (every row full; nanochat's alternative to best fit).
  int64_t rows = 0, free = 0, discarded = 0;
  for (int64_t i : order) {
    int64_t len = length[i];
    if (free == 0) ++rows, free = max_len;
    if (len > free) discarded += len - free, len = free;
    free -= len;
  }
  const int64_t greedy_batches = (rows + batch - 1) / batch;
  fmt::print("| greedy rows, cropping | {} | {:.0f} | {:.1f}% | {:.1f}% | {:.1f}% | |\n", greedy_batches,
             static_cast<double>(tokens - discarded) / static_cast<double>(greedy_batches),
             pct(static_cast<double>(tokens - discarded), static_cast<double>(greedy_batches) * cap),
             pct(static_cast<double>(rows * max_len - (tokens - discarded)), static_cast<double>(rows * max_len)),
             pct(static_cast<double>(discarded), static_cast<double>(tokens)));
  const auto t0 = std::chrono::steady_clock::now();
  const RowPlan plan = best_fit_rows(order, length, max_len, 1, 0, true);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const int64_t fit_batches = (plan.rows() + batch - 1) / batch;
  fmt::print("| **packing: best_fit** | {} | {:.0f} | {:.1f}% | {:.2f}% | 0 | {:.1f} |\n", fit_batches,
             static_cast<double>(tokens) / static_cast<double>(fit_batches), pct(static_cast<double>(tokens), static_cast<double>(fit_batches) * cap),
             pct(static_cast<double>(plan.padding()), static_cast<double>(plan.rows() * max_len)), ms);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  try {
    if (a.size() == 3 && a[0] == "fashion-folder") return fashion_folder(a[1], std::stoi(a[2]));
    if ((a.size() == 5 || a.size() == 6) && a[0] == "photo-folder")
      return photo_folder(a[1], std::stoi(a[2]), std::stoi(a[3]), std::stoull(a[4]), a.size() == 6 ? std::stod(a[5]) : 6.0);
    if (a.size() == 2 && a[0] == "list") return list(a[1]);
    if (a.size() == 5 && a[0] == "pack-stats") return pack_stats(a[1], std::stoll(a[2]), std::stoll(a[3]), std::stoll(a[4]));
    if (a.size() >= 5 && a[0] == "decode") return decode(std::stoi(a[1]), std::stod(a[2]), a[3], {a.begin() + 4, a.end()});
  } catch (const DataError& e) {
    fmt::print(stderr, "strobe_data_tool: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "strobe_data_tool: {}\n", e.what());
    return 1;
  }
  fmt::print(stderr,
             "usage: strobe_data_tool fashion-folder OUT PER_CLASS | photo-folder OUT N CLASSES SEED | list ROOT |"
             " decode CHANNELS MIN_SCALE OUT_DIR FILE... | pack-stats FILE EOT MAX_SEQ_LEN BATCH\n");
  return 2;
}
