#include "strobe/data/batch.h"

#include <stdexcept>

#include <fmt/format.h>
#include <torch/torch.h>

namespace strobe {

const torch::Tensor& Batch::at(const std::string& key) const {
  auto it = tensors.find(key);
  if (it == tensors.end()) {
    std::string keys;
    for (const auto& kv : tensors) keys += (keys.empty() ? "" : ", ") + kv.first;
    throw std::runtime_error(fmt::format("batch has no '{}' (it has: {})", key, keys));
  }
  return it->second;
}

int64_t Batch::batch_size() const {
  auto it = meta.find("batch_size");
  if (it != meta.end()) return it->second;
  return tensors.empty() ? 0 : tensors.begin()->second.size(0);
}

Batch Batch::to(const torch::Device& device, bool non_blocking) const {
  Batch out;
  out.meta = meta;
  out.indices = indices;
  for (const auto& kv : tensors) out.tensors[kv.first] = kv.second.to(device, non_blocking);
  return out;
}

Batch Batch::pin_memory() const {
  Batch out;
  out.meta = meta;
  out.indices = indices;
  for (const auto& kv : tensors) out.tensors[kv.first] = kv.second.is_pinned() ? kv.second : kv.second.pin_memory();
  return out;
}

Batch Batch::clone() const {
  Batch out;
  out.meta = meta;
  out.indices = indices;
  for (const auto& kv : tensors) out.tensors[kv.first] = kv.second.clone();
  return out;
}

}  // namespace strobe
