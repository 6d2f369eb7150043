// CudaGraph: capture and replay of a whole training step (trainer.cuda_graphs), wrapping
// at::cuda::CUDAGraph so that the trainer (strobe_core) includes no CUDA header.
//
// capture() first returns the allocator's cached free memory to the device (one synchronization),
// then runs `body` once on a side stream of the device under stream capture: its kernels are
// recorded into the graph, not executed, and every tensor the body allocates comes from the graph's
// private memory pool, at the same address on every replay. replay() launches the recorded kernels
// on the device's current stream (one launch instead of thousands). What may not happen inside the
// body: a host read of a device value (.item(), a blocking copy), a host-to-device copy from pageable
// memory, a kernel whose arguments must change from step to step (the optimizers read the learning
// rate from a device tensor for this, FusedOptimizerBase::enable_device_lr). CUDA's own check turns
// such a call into an error naming it; capture() then leaves no capture open and throws.
#pragma once

#include <functional>
#include <memory>

#include <torch/types.h>

namespace strobe::ops {

// Whether the current stream of `device` is being captured into a CUDA graph (false on the CPU and
// in a build without CUDA).
bool stream_capturing(const torch::Device& device);

class CudaGraph {
 public:
  CudaGraph();
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Throws std::runtime_error when capture fails (the graph is then empty) or this build has no CUDA.
  void capture(const torch::Device& device, const std::function<void()>& body);
  void replay();
  // Frees the graph and its memory pool (tensors allocated during capture must be dropped first
  // by their holders; until then their blocks stay reserved).
  void reset();
  bool captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Whether this build can capture CUDA graphs (the op library's CUDA glue is compiled in).
bool cuda_graphs_supported();

}  // namespace strobe::ops
