// TEST DOUBLE — not part of Strobe's product. A c10d::Backend whose collectives move CPU tensors
// through the job's c10d::TCPStore (c10d::StoreCollectives: every rank publishes its bytes, every
// rank reduces all contributions in rank order). It exists because the libtorch wheel compiles
// ProcessGroupGloo but ships none of gloo's headers, so CPU CI has no real c10d CPU backend to
// construct. Registered through distributed::set_cpu_backend_factory, it lets the real strategy
// code (TCPStore rendezvous, c10d::ProcessGroup dispatch, c10d::Reducer's bucketed hooks, metric
// syncs, health monitor) run across real processes on 127.0.0.1. Slow (every byte goes through the
// store's host) and synchronous: for tests only. See docs/DISTRIBUTED.md.
#pragma once

#include <chrono>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "strobe/distributed/strategy.h"

namespace strobe::testing {

c10::intrusive_ptr<c10d::Backend> make_store_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                     std::chrono::milliseconds timeout);

// All-reduce calls this process has made through the double (lets tests see bucketing at work).
int64_t store_backend_allreduce_calls();
// Reduce-scatter (_reduce_scatter_base, reduce_scatter_tensor_coalesced) and all-gather into one
// tensor (_allgather_base, allgather_into_tensor_coalesced) calls this process completed, a
// coalesced call counting once.
int64_t store_backend_reduce_scatter_calls();
int64_t store_backend_allgather_calls();

// Installs make_store_backend as the strategy's CPU backend factory.
void install_store_backend();

}  // namespace strobe::testing
