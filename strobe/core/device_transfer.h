// Host-to-device batch copies on a dedicated copy stream.
//
// On CUDA the trainer runs the data module's transfer_batch_to_device with a side stream current,
// so the copies of batch n+1 (pinned host memory, non_blocking) run while the compute stream is
// still busy with step n (the host is ahead of the GPU: nothing in a step syncs). The compute stream
// then waits on an event for the copies, and the batch's device memory is recorded as used by the
// compute stream, so the caching allocator does not hand it back to the copy stream while a kernel
// still reads it. Other devices: the transfer runs as it is.
#pragma once

#include <functional>
#include <optional>

#include <c10/core/Stream.h>
#include <torch/types.h>

#include "strobe/data/batch.h"

namespace strobe {

class BatchTransfer {
 public:
  // `transfer` copies the batch to `device` (DataModule::transfer_batch_to_device); its result's
  // device tensors are safe to use on the current stream when this returns.
  Batch operator()(const torch::Device& device, const std::function<Batch()>& transfer);
  // The copy stream in use (after the first CUDA transfer), for tests.
  std::optional<c10::Stream> stream() const { return stream_; }

 private:
  std::optional<c10::Stream> stream_;
};

}  // namespace strobe
