#include "strobe/core/master_weights.h"

#include <unordered_set>

#include <torch/torch.h>

namespace strobe {

bool is_batch_norm(torch::nn::Module& m) {
  return m.as<torch::nn::BatchNorm1d>() || m.as<torch::nn::BatchNorm2d>() || m.as<torch::nn::BatchNorm3d>();
}

MasterWeights::MasterWeights(torch::nn::Module& net, c10::ScalarType dtype) { convert(net, dtype, std::nullopt); }

MasterWeights::MasterWeights(torch::nn::Module& net, c10::ScalarType dtype, const torch::Device& device) {
  convert(net, dtype, device);
}

void MasterWeights::convert(torch::nn::Module& net, c10::ScalarType dtype, const std::optional<torch::Device>& host_to) {
  torch::NoGradGuard no_grad;
  for (const auto& item : net.named_modules()) {
    torch::nn::Module& m = *item.value();
    if (is_batch_norm(m)) continue;
    for (auto& p : m.named_parameters(/*recurse=*/false)) {
      torch::Tensor param = p.value();
      if (!param.is_floating_point() || param.scalar_type() == dtype) continue;
      // On the device: a copy beside the parameter. The host-side build: the host value itself.
      torch::Tensor master = host_to ? param.detach().to(torch::kFloat32)
                                     : param.detach().to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
      // set_data keeps the parameter object (hooks, the module's registration) and its layout.
      param.set_data(host_to ? param.detach().to(*host_to, dtype) : param.detach().to(dtype));
      index_[param.unsafeGetTensorImpl()] = model_.size();
      model_.push_back(param);
      master_.push_back(master);
    }
    for (auto& b : m.named_buffers(/*recurse=*/false)) {
      torch::Tensor buf = b.value();
      if (buf.is_floating_point() && buf.scalar_type() != dtype) buf.set_data(host_to ? buf.to(*host_to, dtype) : buf.to(dtype));
    }
  }
}

std::vector<torch::Tensor> MasterWeights::optimizer_params(const std::vector<torch::Tensor>& params) const {
  std::vector<torch::Tensor> out;
  out.reserve(params.size());
  for (const auto& p : params) out.push_back(master_of(p));
  return out;
}

const torch::Tensor& MasterWeights::master_of(const torch::Tensor& param) const {
  auto it = index_.find(param.unsafeGetTensorImpl());
  return it == index_.end() ? param : master_[it->second];
}

void MasterWeights::drop_masters(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> model, master;
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  std::unordered_set<const c10::TensorImpl*> dropped;
  for (const auto& p : params) dropped.insert(p.unsafeGetTensorImpl());
  for (size_t i = 0; i < model_.size(); ++i) {
    if (dropped.count(model_[i].unsafeGetTensorImpl())) continue;
    index[model_[i].unsafeGetTensorImpl()] = model.size();
    model.push_back(model_[i]);
    master.push_back(master_[i]);
  }
  model_ = std::move(model);
  master_ = std::move(master);
  index_ = std::move(index);
}

void MasterWeights::move_masters(const torch::Device& device) {
  for (auto& m : master_) m = m.to(device);
}

void MasterWeights::attach_grads(bool fp32_copies) {
  for (size_t i = 0; i < model_.size(); ++i) {
    const auto& g = model_[i].grad();
    master_[i].mutable_grad() = g.defined() && fp32_copies ? g.to(torch::kFloat32) : g;
  }
}

void MasterWeights::copy_to_model() {
  if (model_.empty()) return;
  torch::NoGradGuard no_grad;  // in place on the parameters themselves: no per-step detached views
  at::_foreach_copy_(model_, master_);
}

void MasterWeights::release_grads() {
  for (auto& m : master_) m.mutable_grad() = torch::Tensor();
}

}  // namespace strobe
