#include "strobe/data/dataset.h"

#include <stdexcept>

#include <fmt/format.h>
#include <torch/torch.h>

namespace strobe::data {
namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

at::Generator sample_generator(uint64_t seed, int64_t epoch, int64_t index) {
  uint64_t s = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(epoch) * 0x100000001B3ull ^ splitmix64(index)));
  return at::make_generator<at::CPUGeneratorImpl>(s);
}

Batch stack_collate(std::vector<Sample>& samples) {
  if (samples.empty()) throw std::runtime_error("stack_collate: empty batch");
  Batch b;
  for (const auto& kv : samples.front()) {
    std::vector<torch::Tensor> parts;
    parts.reserve(samples.size());
    for (auto& s : samples) {
      auto it = s.find(kv.first);
      if (it == s.end()) throw std::runtime_error(fmt::format("stack_collate: a sample lacks '{}'", kv.first));
      parts.push_back(it->second);
    }
    if (collate_pins()) {
      // Stacked straight into pinned memory (the loader's batch for a GPU run): no second copy.
      auto sizes = parts.front().sizes().vec();
      sizes.insert(sizes.begin(), static_cast<int64_t>(parts.size()));
      auto out = torch::empty(sizes, parts.front().options().pinned_memory(true));
      b.tensors[kv.first] = torch::stack_out(out, parts);
    } else {
      b.tensors[kv.first] = torch::stack(parts);
    }
  }
  b.meta["batch_size"] = static_cast<int64_t>(samples.size());
  return b;
}

SubsetDataset::SubsetDataset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices)
    : base_(std::move(base)), indices_(std::move(indices)) {
  for (int64_t i : indices_)
    if (i < 0 || i >= base_->size()) throw std::out_of_range("SubsetDataset: index out of range");
}

Sample SubsetDataset::get(int64_t index, at::Generator& gen) const { return base_->get(indices_.at(index), gen); }

}  // namespace strobe::data
