// TEST DOUBLE (see store_backend.h).
#include "tests/distributed/store_backend.h"

#include <atomic>
#include <cstring>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/control_collectives/StoreCollectives.hpp>
#include <torch/torch.h>

namespace strobe::testing {

namespace {

std::atomic<int64_t> g_allreduce_calls{0}, g_reduce_scatter_calls{0}, g_allgather_calls{0};

std::vector<uint8_t> to_bytes(const torch::Tensor& t) {
  auto c = t.detach().to(torch::kCPU).contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.nbytes());
}

torch::Tensor from_bytes(const std::vector<uint8_t>& b, const torch::Tensor& like) {
  auto out = torch::empty(like.sizes(), like.options().device(torch::kCPU));
  // A failed collective, as NCCL's errors are (c10::DistBackendError): the ranks issued different
  // collectives at this point.
  if (static_cast<size_t>(out.nbytes()) != b.size())
    C10_THROW_ERROR(DistBackendError, "store backend: ranks disagree on a tensor's size");
  std::memcpy(out.data_ptr(), b.data(), b.size());
  return out;
}

c10::intrusive_ptr<c10d::Work> completed(const std::vector<torch::Tensor>& tensors) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  fut->markCompleted(c10::IValue(tensors));
  return c10d::Work::create_from_future(fut);
}

class StoreBackend final : public c10d::Backend {
 public:
  StoreBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout)
      : c10d::Backend(rank, size), coll_(store, rank, size), timeout_(timeout) {}

  const std::string getBackendName() const override { return "strobe_test_store"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    ++g_allreduce_calls;
    for (auto& t : tensors) {
      auto all = coll_.allGather(key("allreduce"), to_bytes(t), timeout_);
      std::vector<torch::Tensor> parts;
      for (auto& b : all) parts.push_back(from_bytes(b, t));
      torch::NoGradGuard ng;
      t.copy_(reduce(parts, opts.reduceOp));
    }
    return completed(tensors);
  }

  // The reduce-scatters: rank r's output is the reduction (in rank order, as allreduce) of chunk r
  // of every rank's input, the input read flat as world_size chunks of the output's numel.
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    reduce_scatter_one(output, input, opts.reduceOp, "reduce_scatter_base");
    ++g_reduce_scatter_calls;
    return completed({output});
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "store backend: reduce_scatter_tensor_coalesced needs one output per input");
    for (size_t i = 0; i < inputs.size(); ++i) reduce_scatter_one(outputs[i], inputs[i], opts.reduceOp, "reduce_scatter_coalesced");
    ++g_reduce_scatter_calls;
    return completed(outputs);
  }

  // The all-gathers into one tensor: the output, read flat, is every rank's input in rank order.
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) override {
    allgather_one(output, input, "allgather_base");
    ++g_allgather_calls;
    return completed({output});
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions&) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "store backend: allgather_into_tensor_coalesced needs one output per input");
    for (size_t i = 0; i < inputs.size(); ++i) allgather_one(outputs[i], inputs[i], "allgather_coalesced");
    ++g_allgather_calls;
    return completed(outputs);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    for (auto& t : tensors) {
      auto k = key("broadcast");
      torch::NoGradGuard ng;
      if (getRank() == opts.rootRank)
        coll_.broadcastSend(k, to_bytes(t), timeout_);
      else
        t.copy_(from_bytes(coll_.broadcastRecv(k, timeout_), t));
    }
    return completed(tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    TORCH_CHECK(inputs.size() == outputs.size(), "store backend: allgather needs one output list per input");
    std::vector<at::Tensor> flat;
    for (size_t i = 0; i < inputs.size(); ++i) {
      auto all = coll_.allGather(key("allgather"), to_bytes(inputs[i]), timeout_);
      TORCH_CHECK(outputs[i].size() == all.size(), "store backend: allgather output list has the wrong length");
      torch::NoGradGuard ng;
      for (size_t r = 0; r < all.size(); ++r) {
        outputs[i][r].copy_(from_bytes(all[r], outputs[i][r]));
        flat.push_back(outputs[i][r]);
      }
    }
    return completed(flat);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    coll_.barrier(key("barrier"), timeout_, true);
    return completed({});
  }

 private:
  std::string key(const char* op) { return fmt::format("{}/{}", op, seq_++); }

  static torch::Tensor reduce(const std::vector<torch::Tensor>& parts, c10d::ReduceOp op) {
    auto acc = parts[0].clone();
    for (size_t r = 1; r < parts.size(); ++r) {
      const auto& x = parts[r];
      switch (op) {
        case c10d::ReduceOp::SUM: acc.add_(x); break;
        case c10d::ReduceOp::AVG: acc.add_(x); break;
        case c10d::ReduceOp::MAX: acc = torch::maximum(acc, x); break;
        case c10d::ReduceOp::MIN: acc = torch::minimum(acc, x); break;
        default: TORCH_CHECK(false, "store backend: unsupported reduce op");
      }
    }
    if (op == c10d::ReduceOp::AVG) acc.div_(static_cast<double>(parts.size()));
    return acc;
  }

  void reduce_scatter_one(at::Tensor& output, const at::Tensor& input, c10d::ReduceOp op, const char* what) {
    const int64_t n = output.numel();
    TORCH_CHECK(input.numel() == n * getSize(), "store backend: ", what, ": the input holds ", input.numel(),
                " elements, not world_size x the output's ", n);
    TORCH_CHECK(input.scalar_type() == output.scalar_type(), "store backend: ", what, ": input and output dtypes differ");
    auto all = coll_.allGather(key(what), to_bytes(input), timeout_);
    std::vector<torch::Tensor> parts;
    for (auto& b : all) parts.push_back(from_bytes(b, input).reshape({-1}).narrow(0, getRank() * n, n));
    torch::NoGradGuard ng;
    output.copy_(reduce(parts, op).view(output.sizes()));
  }

  void allgather_one(at::Tensor& output, const at::Tensor& input, const char* what) {
    const int64_t n = input.numel();
    TORCH_CHECK(output.numel() == n * getSize(), "store backend: ", what, ": the output holds ", output.numel(),
                " elements, not world_size x the input's ", n);
    TORCH_CHECK(input.scalar_type() == output.scalar_type(), "store backend: ", what, ": input and output dtypes differ");
    auto all = coll_.allGather(key(what), to_bytes(input), timeout_);
    std::vector<torch::Tensor> parts;
    for (auto& b : all) parts.push_back(from_bytes(b, input).reshape({-1}));
    torch::NoGradGuard ng;
    output.copy_(torch::cat(parts).view(output.sizes()));
  }

  c10d::StoreCollectives coll_;
  std::chrono::milliseconds timeout_;
  uint64_t seq_ = 0;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_store_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                     std::chrono::milliseconds timeout) {
  return c10::make_intrusive<StoreBackend>(store, rank, size, timeout);
}

int64_t store_backend_allreduce_calls() { return g_allreduce_calls.load(); }
int64_t store_backend_reduce_scatter_calls() { return g_reduce_scatter_calls.load(); }
int64_t store_backend_allgather_calls() { return g_allgather_calls.load(); }

void install_store_backend() { distributed::set_cpu_backend_factory(make_store_backend); }

}  // namespace strobe::testing
