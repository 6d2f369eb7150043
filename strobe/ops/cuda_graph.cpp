#include "strobe/ops/cuda_graph.h"

#include <stdexcept>
#include <string>

#ifdef STROBE_OPS_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strobe::ops {

#ifdef STROBE_OPS_WITH_CUDA

struct CudaGraph::Impl {
  at::cuda::CUDAGraph graph;
  c10::DeviceIndex device = 0;
  bool captured = false;
};

CudaGraph::CudaGraph() = default;
CudaGraph::~CudaGraph() = default;

bool cuda_graphs_supported() { return true; }

void CudaGraph::capture(const torch::Device& device, const std::function<void()>& body) {
  if (!device.is_cuda()) throw std::runtime_error("CUDA graph capture needs a CUDA device, not " + device.str());
  reset();
  impl_ = std::make_unique<Impl>();
  impl_->device = device.index() < 0 ? c10::cuda::current_device() : device.index();
  const c10::cuda::CUDAGuard device_guard(impl_->device);
  // The eager steps before the capture left their activations cached in the allocator's general
  // pool, which the graph's private pool cannot use: hand them back to the device first (one
  // synchronization, once per capture), so a captured step needs about the memory of an eager one.
  c10::cuda::CUDACachingAllocator::emptyCache();
  // Capture needs a stream other than the legacy default one; it starts after what the current
  // stream has queued (the static inputs' copies) and the current stream continues after it.
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(impl_->device);
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, impl_->device);
  at::cuda::CUDAEvent before;
  before.record(current);
  before.block(side);
  std::string error;
  {
    const c10::cuda::CUDAStreamGuard stream_guard(side);
    // Thread-local: the loader's threads may allocate pinned memory meanwhile (not part of the
    // step); the autograd engine's device thread still records into this stream's capture.
    impl_->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      body();
    } catch (const std::exception& e) {
      error = e.what();
    }
    try {
      impl_->graph.capture_end();
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
  }
  at::cuda::CUDAEvent after;
  after.record(side);
  after.block(current);
  if (!error.empty()) {
    impl_.reset();
    // The first line of the underlying error names the operation CUDA refused during capture.
    throw std::runtime_error(error.substr(0, error.find('\n')));
  }
  impl_->captured = true;
}

void CudaGraph::replay() {
  if (!captured()) throw std::logic_error("CudaGraph::replay() before a successful capture()");
  const c10::cuda::CUDAGuard device_guard(impl_->device);
  impl_->graph.replay();
}

void CudaGraph::reset() { impl_.reset(); }

bool CudaGraph::captured() const { return impl_ && impl_->captured; }

bool stream_capturing(const torch::Device& device) {
  if (!device.is_cuda()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

#else

struct CudaGraph::Impl {};
CudaGraph::CudaGraph() = default;
CudaGraph::~CudaGraph() = default;
bool cuda_graphs_supported() { return false; }
void CudaGraph::capture(const torch::Device&, const std::function<void()>&) {
  throw std::runtime_error("this build's operator library has no CUDA support: CUDA graphs are unavailable");
}
void CudaGraph::replay() { throw std::logic_error("CudaGraph::replay() in a build without CUDA"); }
void CudaGraph::reset() {}
bool CudaGraph::captured() const { return false; }
bool stream_capturing(const torch::Device&) { return false; }

#endif

}  // namespace strobe::ops
