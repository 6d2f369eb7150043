// The NCCL backend of c10d (ProcessGroupNCCL), kept in its own translation unit: its header needs
// nccl.h and the CUDA runtime headers, which CPU-only builds do not have.
#pragma once

#include <chrono>
#include <string>

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

// c10d's flight recorder of this process's NCCL collectives (ProcessGroupNCCL records every one it
// enqueues: TORCH_NCCL_TRACE_BUFFER_SIZE entries, 2000 by default) as c10d::dump_nccl_trace_json
// writes it: {"version", "pg_config", "pg_status", "entries": [{"collective_seq_id",
// "profiling_name", "state", "input_sizes", ...}]}. "" without NCCL or when the dump fails.
std::string nccl_flight_record_json();

// Makes `index` the calling thread's current CUDA device (no-op without CUDA).
void set_current_cuda_device(int index);

}  // namespace strobe::distributed
