// Model: a network built from the `model:` config section. forward() takes the whole batch so each
// model reads the inputs it needs ("image", "tokens" + "cu_seqlens"/"position_ids", ...).
#pragma once

#include <memory>

#include <torch/nn/module.h>

#include "framework/core/batch.h"
#include "framework/core/registry.h"

namespace strobe {

class Model : public torch::nn::Module {
 public:
  explicit Model(const std::string& name) : torch::nn::Module(name) {}
  virtual torch::Tensor forward(const Batch& batch) = 0;
  // The task a model trains with when `task:` names none (e.g. resnet -> classification).
  virtual std::string default_task() const = 0;
};

using ModelRegistry = Registry<std::shared_ptr<Model>>;
ModelRegistry& model_registry();

}  // namespace strobe
