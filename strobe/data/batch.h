// Batch: what flows from the loader through the batch hooks into a step — named tensors plus
// host-side facts fixed at collate time (e.g. max_seqlen for varlen attention, so launching a kernel
// never needs a device-to-host read).
#pragma once

#include <map>
#include <string>
#include <vector>

#include <torch/types.h>

namespace strobe {

// One dataset item: named CPU tensors (e.g. {"image": [1,28,28] float, "label": [] int64}).
using Sample = std::map<std::string, torch::Tensor>;

// The loader's position, in every batch's meta: bookkeeping, not a fact that shapes a step.
constexpr const char* kMetaBatchIndex = "batch_index";
constexpr const char* kMetaEpoch = "epoch";
// A mix's count of each source's sequences in the batch ("source/<s>"): bookkeeping too.
constexpr const char* kMetaSourcePrefix = "source/";
// Packing (data.packing): the rows of max_seq_len tokens the batch's sequences were placed in.
constexpr const char* kMetaRows = "rows";

struct Batch {
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, int64_t> meta;  // host-side facts; "batch_size" is always set by collate
  // The dataset indices of the batch's samples, in row order (the loader sets them; a sample the
  // dataset skipped as bad has none). Host data, not a tensor: CUDA-graph signatures hash every
  // tensor, and these change with every batch. Empty: not known (a hand-made batch).
  std::vector<int64_t> indices;

  bool has(const std::string& key) const { return tensors.count(key) > 0; }
  const torch::Tensor& at(const std::string& key) const;  // throws naming the missing key
  torch::Tensor& operator[](const std::string& key) { return tensors[key]; }
  int64_t batch_size() const;

  // Copies every tensor to `device`; with non_blocking the source must be pinned to overlap.
  Batch to(const torch::Device& device, bool non_blocking = false) const;
  Batch pin_memory() const;
  Batch clone() const;
};

}  // namespace strobe
