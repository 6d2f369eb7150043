// Helpers for model tests: build a registered model from a YAML snippet, count parameters, copy weights.
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/model.h"
#include "strobe/data/batch.h"

namespace strobe::testing {

inline std::shared_ptr<Model> build_model(const std::string& yaml) {
  auto doc = config::Document::load_string(yaml, "test.yaml");
  auto section = doc.root();
  return model_registry().create(section, "");
}

inline int64_t count_parameters(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

inline void copy_weights(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard guard;
  auto src = from.named_parameters();
  for (auto& kv : to.named_parameters()) kv.value().copy_(src[kv.key()]);
}

// One token sequence per length, tokens in [1, vocab): {"tokens": seq[0:n], "targets": seq[1:n+1]}, as
// a token dataset yields them (collate with data::collate_tokens_padded / _packed).
inline std::vector<Sample> token_samples(const std::vector<int64_t>& lengths, int64_t vocab) {
  std::vector<Sample> out;
  for (int64_t n : lengths) {
    auto seq = torch::randint(1, vocab, {n + 1}, torch::kInt64);
    out.push_back({{"tokens", seq.narrow(0, 0, n)}, {"targets", seq.narrow(0, 1, n)}});
  }
  return out;
}

inline Batch image_batch(torch::Tensor image) {
  Batch b;
  b.meta["batch_size"] = image.size(0);
  b.tensors["image"] = std::move(image);
  return b;
}

}  // namespace strobe::testing
