#include "strobe/core/precision.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"

namespace strobe {

AutocastGuard::AutocastGuard(const torch::Device& device, Precision precision) : type_(device.type()) {
  if (!autocasts(precision)) return;  // 32, and bf16-master: bf16 weights, no autocast
  active_ = true;
  prev_enabled_ = at::autocast::is_autocast_enabled(type_);
  prev_dtype_ = at::autocast::get_autocast_dtype(type_);
  at::autocast::set_autocast_dtype(type_, precision == Precision::k16Mixed ? at::kHalf : at::kBFloat16);
  at::autocast::set_autocast_enabled(type_, true);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(type_, prev_enabled_);
  at::autocast::set_autocast_dtype(type_, prev_dtype_);
}

GradScaler::GradScaler(const torch::Device& device, double init_scale, double growth_factor, double backoff_factor,
                       int64_t growth_interval)
    : growth_(growth_factor), backoff_(backoff_factor), interval_(growth_interval) {
  auto f = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  scale_ = torch::full({}, init_scale, f);
  growth_tracker_ = torch::zeros({}, f.dtype(torch::kInt32));
}

void GradScaler::update(const torch::Tensor& found_inf) {
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf, growth_, backoff_, interval_);
}

void GradScaler::load(const torch::Tensor& scale, const torch::Tensor& growth_tracker) {
  scale_.copy_(scale);
  growth_tracker_.copy_(growth_tracker);
}

void GradScaler::save(checkpoint::CheckpointData& d, const StepStart*) {
  d.tensors["scaler/scale"] = scale_;
  d.tensors["scaler/growth_tracker"] = growth_tracker_;
}

void GradScaler::load(const checkpoint::CheckpointData& d) {
  if (d.tensors.count("scaler/scale")) load(d.tensor("scaler/scale"), d.tensor("scaler/growth_tracker"));
}

}  // namespace strobe
