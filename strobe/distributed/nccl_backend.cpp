#include "strobe/distributed/nccl_backend.h"

#include "strobe/distributed/strategy.h"

#if defined(STROBE_TORCH_HAS_CUDA) && __has_include(<nccl.h>) && __has_include(<cuda_runtime_api.h>)
#define STROBE_HAVE_NCCL 1
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <c10/cuda/CUDAFunctions.h>
#include <fmt/format.h>
#include <torch/csrc/cuda/nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#else
#define STROBE_HAVE_NCCL 0
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

namespace strobe::distributed {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout) {
#if STROBE_HAVE_NCCL
  // ProcessGroupNCCL's members depend on NCCL's version macros: the nccl.h compiled here must be the
  // NCCL torch was built with, or the object we allocate would not match the library's layout.
  const uint64_t built = torch::cuda::nccl::version();
  const uint64_t major = built >> 32, minor = (built >> 16) & 0xffff;
  if (major != NCCL_MAJOR || minor != NCCL_MINOR)
    throw DistributedError(fmt::format("this Strobe was compiled with nccl.h {}.{} but libtorch was built with NCCL {}.{}; "
                                       "rebuild Strobe against the NCCL headers of the installed torch",
                                       NCCL_MAJOR, NCCL_MINOR, major, minor));
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  opts->group_name = "0";  // the default group's name in torch.distributed
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
#else
  (void)store, (void)rank, (void)size, (void)timeout;
  throw DistributedError("this Strobe build has no NCCL (built without CUDA or without nccl.h)");
#endif
}

std::string nccl_flight_record_json() {
#if STROBE_HAVE_NCCL
  try {
    return c10d::dump_nccl_trace_json(/*includeCollectives=*/true, /*onlyActive=*/false);
  } catch (const std::exception&) {
    return "";
  }
#else
  return "";
#endif
}

void set_current_cuda_device(int index) {
#if STROBE_HAVE_NCCL
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
#else
  (void)index;
#endif
}

}  // namespace strobe::distributed
