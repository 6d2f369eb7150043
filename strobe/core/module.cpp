#include "strobe/core/module.h"

#include <torch/torch.h>

namespace strobe {

torch::Tensor Module::predict_step(const Batch& batch, int64_t) {
  auto* model = dynamic_cast<Model*>(&net());
  if (!model) throw std::runtime_error("predict_step: the module's network is not a strobe::Model; override predict_step");
  return model->forward(batch);
}

void Module::log(const std::string& name, const torch::Tensor& value, const LogOptions& options, int64_t weight) {
  if (sink_) sink_->log(name, value, options, weight);
}

void Module::log(const std::string& name, const torch::Tensor& value, const LogOptions& options) {
  if (sink_) sink_->log(name, value, options, batch_size_);
}

}  // namespace strobe
