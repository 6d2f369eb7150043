// The data-parallel strategy over a c10d process group (ddp, zero2; not installed): built by
// make_strategy (strategy.h) when the job has more than one process.
#pragma once

#include <memory>

#include <torch/types.h>

#include "strobe/distributed/launch_env.h"
#include "strobe/distributed/strategy.h"

namespace strobe::distributed::detail {

// The CPU process group's factory (set_cpu_backend_factory; empty: none, multi-process runs need CUDA).
CpuBackendFactory& cpu_backend_factory();

std::unique_ptr<Strategy> make_ddp_strategy(const StrategyOptions& options, const LaunchEnv& env, torch::Device device);

}  // namespace strobe::distributed::detail
