// DeviceReadback: a device value read on the host without stalling the step path. start() copies the
// value into pinned host memory on the current stream (non-blocking) and records an event after the
// copy; ready() asks whether the copy has landed without waiting; wait() blocks until it has. On
// the CPU the copy is synchronous and ready at once. The host buffer is reused while it is large
// enough, so a ring of readbacks allocates pinned memory once. Used by the log collector's ring, the
// trainer's cross-rank stop flag and NaN capture's verdicts.
#pragma once

#include <memory>

#include <torch/types.h>

namespace c10 {
struct Event;
}

namespace strobe {

class DeviceReadback {
 public:
  DeviceReadback();
  ~DeviceReadback();
  DeviceReadback(DeviceReadback&&) noexcept;
  DeviceReadback& operator=(DeviceReadback&&) noexcept;

  // Starts copying `value` (any device, any dtype) to the host. Must not be called while a copy is
  // pending (wait() first): the buffer is reused.
  void start(const torch::Tensor& value);
  bool started() const { return host_.defined(); }
  // The last value came from a CUDA device: its copy lands asynchronously (ready() may be false).
  bool asynchronous() const { return event_ != nullptr; }
  // The copy has landed (never blocks; true on the CPU).
  bool ready() const;
  // Blocks until the copy has landed; returns the host copy (the value's shape and dtype).
  const torch::Tensor& wait();
  // The host copy; valid once ready() (or after wait()).
  const torch::Tensor& host() const { return host_; }

 private:
  torch::Tensor buffer_;  // reused storage: pinned for CUDA values
  torch::Tensor host_;    // the view of buffer_ holding the last value
  bool pinned_ = false;
  std::unique_ptr<c10::Event> event_;
};

}  // namespace strobe
