// The default generators' states, read and restored under each generator's lock: the trainer's
// checkpointed RNG (trainer_state.cpp) and activation checkpointing's recompute
// (activation_checkpoint.cpp). `device` -1 is the CPU's generator, otherwise that CUDA device's.
#pragma once

#include <mutex>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/types.h>

namespace strobe {

inline at::Generator default_generator(int device) {
  return device < 0 ? at::detail::getDefaultCPUGenerator()
                    : at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
}

inline torch::Tensor generator_state(int device) {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

inline void set_generator_state(int device, const torch::Tensor& state) {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace strobe
