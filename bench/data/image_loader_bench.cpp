// bench_image_loader ROOT WORKERS BATCH EPOCHS TRANSFORM [extra YAML lines...]
// Images/s of the image_folder data module's train loader (built through the registry, as a run
// builds it): TRANSFORM train = random-resized-crop 224 + flip + normalize, eval = resize 256 +
// center-crop 224 + normalize. ROOT "synthetic:N": synthetic_images instead (N samples of 3 x 224 x
// 224 in 20 classes, configs/resnet50_nan.yaml's data; TRANSFORM unused). Each epoch runs the whole folder; the first two batches of an epoch
// (thread start, cold caches) are not timed. Prints one JSON line with every epoch's rate and the
// median.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/datamodule.h"

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: bench_image_loader ROOT WORKERS BATCH EPOCHS train|eval [yaml line...]\n");
    return 2;
  }
  const std::string root = argv[1], transform = argv[5];
  const int workers = std::atoi(argv[2]), batch = std::atoi(argv[3]), epochs = std::atoi(argv[4]);
  std::string yaml = root.rfind("synthetic:", 0) == 0
                         ? fmt::format("name: synthetic_images\nimage_size: 224\nchannels: 3\nnum_classes: 20\nnum_samples: {}\n"
                                       "num_val_samples: 0\nbatch_size: {}\nnum_workers: {}\nprefetch_factor: 2\ndrop_last: true\n",
                                       root.substr(10), batch, workers)
                         : fmt::format("name: image_folder\nroot: {}\nimage_size: 224\nresize_size: 256\nbatch_size: {}\nnum_workers: {}\n"
                                 "prefetch_factor: 2\ndrop_last: true\ntrain_transform: {}\nhflip: {}\n",
                                 root, batch, workers, transform == "train" ? "random_resized_crop" : "resize_center_crop",
                                 transform == "train" ? "true" : "false");
  // As a run on a GPU builds it: batches in pinned memory (STROBE_BENCH_PIN=0: pageable).
  const char* pin = std::getenv("STROBE_BENCH_PIN");  for (int i = 6; i < argc; ++i) yaml += std::string(argv[i]) + "\n";
  torch::set_num_threads(1);
  auto doc = strobe::config::Document::load_string(yaml, "bench.yaml");
  auto section = doc.root();
  strobe::DataContext ctx;
  ctx.seed = 1;
  ctx.pin_memory = torch::cuda::is_available() && !(pin && std::string(pin) == "0");
  auto dm = strobe::data_registry().create(section, "", ctx);
  auto loader = dm->train_loader();
  std::vector<double> rates;
  int64_t checksum = 0;
  for (int e = 0; e < epochs; ++e) {
    loader->start(e);
    int64_t n = 0, k = 0;
    auto t0 = std::chrono::steady_clock::now();
    while (auto b = loader->next()) {
      if (k == 1) t0 = std::chrono::steady_clock::now();
      if (k >= 2) n += b->batch_size();
      checksum += b->at("label").sum().item<int64_t>();
      ++k;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(n / s);
  }
  auto sorted = rates;
  std::sort(sorted.begin(), sorted.end());
  fmt::print("{{\"loader\": \"strobe\", \"transform\": \"{}\", \"workers\": {}, \"batch\": {}, \"images\": {}, \"rates\": [{:.1f}], "
             "\"median_images_per_s\": {:.1f}, \"checksum\": {}}}\n",
             transform, workers, batch, loader->dataset().size(), fmt::join(rates, ", "), sorted[sorted.size() / 2], checksum);
  return 0;
}
