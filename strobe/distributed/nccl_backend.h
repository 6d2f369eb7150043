// The NCCL backend of c10d (ProcessGroupNCCL), kept in its own translation unit: its header needs
// nccl.h and the CUDA runtime headers, which CPU-only builds do not have.
#pragma once

#include <chrono>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace strobe::distributed {

// ProcessGroupNCCL over `store` with `timeout` as its collective timeout (the watchdog aborts a
// collective that does not finish within it). Throws DistributedError when NCCL is not built in.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout);

// Makes `index` the calling thread's current CUDA device (no-op without CUDA).
void set_current_cuda_device(int index);

}  // namespace strobe::distributed
