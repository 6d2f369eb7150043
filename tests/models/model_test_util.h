// Helpers for model tests: build a registered model from a YAML snippet, count parameters, copy weights.
#pragma once

#include <string>

#include <torch/torch.h>

#include "framework/config/config.h"
#include "framework/core/model.h"

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

inline Batch image_batch(torch::Tensor image) {
  Batch b;
  b.meta["batch_size"] = image.size(0);
  b.tensors["image"] = std::move(image);
  return b;
}

}  // namespace strobe::testing
