// Precision plugins: "32", "bf16-mixed" (autocast on CPU and CUDA), "16-mixed" (autocast fp16 on
// CUDA with dynamic loss scaling).
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>
#include <torch/types.h>

#include "strobe/config/precision.h"
#include "strobe/checkpoint/stateful.h"

namespace strobe {

// Enables autocast for `device` with the precision's dtype for the guard's lifetime.
class AutocastGuard {
 public:
  AutocastGuard(const torch::Device& device, Precision precision);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType type_;
  bool prev_enabled_ = false;
  c10::ScalarType prev_dtype_;
};

// Dynamic loss scaling (PyTorch's GradScaler algorithm) with device-side state: scale, growth
// tracker and the found-inf flag never leave the device.
class GradScaler : public Stateful {
 public:
  explicit GradScaler(const torch::Device& device, double init_scale = 65536.0, double growth_factor = 2.0,
                      double backoff_factor = 0.5, int64_t growth_interval = 2000);
  torch::Tensor scale(const torch::Tensor& loss) const { return loss * scale_; }
  // After a step: `found_inf` (0-d float 0/1 on the device, from the step pipeline's gradient check)
  // backs the scale off, otherwise it grows every growth_interval steps. The gradients are never
  // unscaled in place: the step pipeline hands 1/scale to the optimizer as its gradient multiplier.
  void update(const torch::Tensor& found_inf);
  const torch::Tensor& scale_tensor() const { return scale_; }
  const torch::Tensor& growth_tracker() const { return growth_tracker_; }
  void load(const torch::Tensor& scale, const torch::Tensor& growth_tracker);
  // Stateful (the checkpoint's `scaler` entry): tensors scaler/scale and scaler/growth_tracker.
  void save(checkpoint::CheckpointData& out, const StepStart* step_start) override;
  void load(const checkpoint::CheckpointData& in) override;

 private:
  torch::Tensor scale_, growth_tracker_;
  double growth_, backoff_;
  int64_t interval_;
};

}  // namespace strobe
