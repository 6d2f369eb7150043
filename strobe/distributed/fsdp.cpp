#include "strobe/distributed/fsdp.h"

#include <algorithm>

#include <c10/core/DeviceGuard.h>
#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace strobe::distributed {

namespace {
std::mutex units_mutex;
std::atomic<size_t> attached_count{0};  // read without the lock: a run without units never takes it
std::unordered_map<const torch::nn::Module*, FsdpUnit*>& attached_units() {
  static std::unordered_map<const torch::nn::Module*, FsdpUnit*> units;
  return units;
}
}  // namespace

void attach_unit(const torch::nn::Module& block, FsdpUnit* unit) {
  std::lock_guard<std::mutex> lock(units_mutex);
  if (unit)
    attached_units()[&block] = unit;
  else
    attached_units().erase(&block);
  attached_count = attached_units().size();
}

FsdpUnit* unit_of(const torch::nn::Module& block) {
  if (attached_count == 0) return nullptr;
  std::lock_guard<std::mutex> lock(units_mutex);
  const auto it = attached_units().find(&block);
  return it == attached_units().end() ? nullptr : it->second;
}

FsdpUnit::FsdpUnit(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t rank, int64_t world, std::string name,
                   std::vector<std::pair<std::string, torch::Tensor>> params, FsdpUnitOptions options,
                   std::shared_ptr<FsdpUnitGroup> group, CollectiveRecord* record)
    : pg_(std::move(pg)),
      rank_(rank),
      world_(world),
      name_(std::move(name)),
      options_(options),
      group_(std::move(group)),
      record_(record) {
  TORCH_CHECK(!params.empty(), "fsdp: unit ", name_, " has no parameters");
  TORCH_CHECK(world_ >= 1 && rank_ >= 0 && rank_ < world_, "fsdp: rank ", rank_, " of ", world_);
  torch::NoGradGuard ng;
  const auto options0 = params[0].second.options().requires_grad(false);
  int64_t full = 0, sharded = 0;
  for (auto& [n, p] : params) {
    TORCH_CHECK(p.defined() && p.scalar_type() == options0.dtype().toScalarType() && p.device() == options0.device(),
                "fsdp: unit ", name_, ": ", n, " is not of the unit's dtype and device (", params[0].first, "'s)");
    Slot s;
    s.dim0 = p.dim() > 0 ? p.size(0) : 1;
    s.rest = s.dim0 > 0 ? p.numel() / s.dim0 : 0;
    s.rows = (s.dim0 + world_ - 1) / world_;
    s.full_offset = full;
    s.shard_offset = sharded;
    full += p.numel();
    sharded += s.rows * s.rest;
    slots_.push_back(s);
    names_.push_back(n);
    params_.push_back(p);
  }
  // The unit's storage: the parameters' values end to end; each parameter's data moves onto it.
  auto flat = torch::empty({full}, options0);
  storage_ = flat.storage();
  TORCH_CHECK(storage_.unsafeGetStorageImpl()->allocator() != nullptr, "fsdp: unit ", name_, ": no allocator");
  full_bytes_ = storage_.nbytes();
  sharded_numel_ = sharded;
  options_of_params_ = options0;
  shard_ = torch::zeros({sharded}, options0);
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    const Slot& s = slots_[i];
    auto view_of = [&] {
      return torch::empty({0}, options0).set_(storage_, s.full_offset, p.sizes(), c10::contiguous_strides(p.sizes()));
    };
    auto alias = view_of();
    alias.copy_(p);
    writers_.push_back(view_of());
    p.set_data(alias);
    // This rank's rows: [rank * rows, min(dim0, (rank + 1) * rows)), zero-padded.
    const int64_t first = std::min(s.dim0, rank_ * s.rows), last = std::min(s.dim0, (rank_ + 1) * s.rows);
    if (last > first && s.rest > 0)
      shard_of(i).view({s.rows, s.rest}).narrow(0, 0, last - first).copy_(alias.reshape({s.dim0, s.rest}).narrow(0, first, last - first));
  }
  if (group_) group_->units.push_back(this);
  if (!options_.keep_gathered) free();
}

FsdpUnit::~FsdpUnit() {
  {
    std::lock_guard<std::mutex> lock(units_mutex);
    auto& m = attached_units();
    for (auto it = m.begin(); it != m.end();) it = it->second == this ? m.erase(it) : std::next(it);
    attached_count = m.size();
  }
  if (!group_) return;
  auto& u = group_->units;
  u.erase(std::remove(u.begin(), u.end(), this), u.end());
}

void FsdpUnit::set_shard_sources(std::vector<torch::Tensor> sources) {
  TORCH_CHECK(sources.size() == params_.size(), "fsdp: unit ", name_, ": ", sources.size(), " sources for ",
              params_.size(), " parameters");
  for (size_t i = 0; i < sources.size(); ++i)
    TORCH_CHECK(sources[i].numel() == slots_[i].rows * slots_[i].rest, "fsdp: unit ", name_, ": ", names_[i],
                "'s source has ", sources[i].numel(), " values, not ", slots_[i].rows * slots_[i].rest);
  sources_ = std::move(sources);
  shard_ = torch::Tensor();
}

torch::Tensor FsdpUnit::shard_of(size_t i) const {
  TORCH_CHECK(shard_.defined(), "fsdp: unit ", name_, " keeps no shard of its own (its rows come from the optimizer's shards)");
  const Slot& s = slots_[i];
  std::vector<int64_t> shape{s.rows};
  for (int64_t d = 1; d < params_[i].dim(); ++d) shape.push_back(params_[i].size(d));
  return shard_.narrow(0, s.shard_offset, s.rows * s.rest).view(shape);
}

void FsdpUnit::resize_storage(size_t bytes) {
  auto* impl = storage_.unsafeGetStorageImpl();
  if (impl->nbytes() == bytes) return;
  c10::OptionalDeviceGuard guard(impl->device());
  impl->set_data_ptr_noswap(bytes ? impl->allocator()->allocate(bytes) : at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(bytes);
}

void FsdpUnit::free() {
  if (!gathered_ || options_.keep_gathered) return;
  resize_storage(0);
  gathered_ = false;
}

void FsdpUnit::refresh() {
  gathered_ = false;  // the storage stays allocated; gather() fills it
  gather();
}

void FsdpUnit::start_gather() {
  if (gathered_ || in_flight_) return;
  torch::NoGradGuard ng;
  send_ = shard_;
  if (!sources_.empty()) {
    // The rows rounded from the optimizer's fp32 shards into a transient buffer, one multi-tensor copy.
    send_ = torch::empty({sharded_numel_}, options_of_params_);
    std::vector<torch::Tensor> dst;
    for (size_t i = 0; i < sources_.size(); ++i)
      dst.push_back(send_.narrow(0, slots_[i].shard_offset, slots_[i].rows * slots_[i].rest).view(sources_[i].sizes()));
    at::_foreach_copy_(dst, sources_);
  }
  recv_ = torch::empty({world_ * sharded_numel_}, options_of_params_);
  const int64_t seq = record_ ? record_->issue(CollectiveKind::kUnitGather, static_cast<int64_t>(recv_.nbytes())) : 0;
  work_ = pg_->_allgather_base(recv_, send_);
  if (record_ && seq) record_->returned(seq);
  in_flight_ = true;
}

FsdpUnit* FsdpUnit::neighbour(int step) const {
  if (!group_) return nullptr;
  const auto& u = group_->units;
  auto it = std::find(u.begin(), u.end(), this);
  if (it == u.end()) return nullptr;
  for (auto i = static_cast<std::ptrdiff_t>(it - u.begin()) + step; i >= 0 && i < static_cast<std::ptrdiff_t>(u.size()); i += step) {
    const auto& o = u[static_cast<size_t>(i)]->options();
    if (!o.keep_gathered && (step > 0 || o.backward_gathers)) return u[static_cast<size_t>(i)];
  }
  return nullptr;
}

void FsdpUnit::gather_and_prefetch(int direction) {
  gather();
  if (auto* next = neighbour(direction)) next->start_gather();
}

void FsdpUnit::gather() {
  if (gathered_) return;
  start_gather();
  torch::NoGradGuard ng;
  const int64_t S = sharded_numel_;
  work_->wait();  // on CUDA the current stream waits for the all-gather; the host does not
  work_.reset();
  send_ = torch::Tensor();
  in_flight_ = false;
  auto recv = std::move(recv_);
  resize_storage(full_bytes_);
  gathered_ = true;
  const auto g = recv.view({world_, S});
  for (size_t i = 0; i < params_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.dim0 == 0 || s.rest == 0) continue;
    // Rank r's chunk holds rows [r * rows, (r + 1) * rows): the whole chunks in one strided copy, the
    // last, partly padded one in another.
    auto dst = writers_[i].view({s.dim0, s.rest});
    auto src = g.narrow(1, s.shard_offset, s.rows * s.rest).view({world_, s.rows, s.rest});
    const int64_t whole = s.dim0 / s.rows, left = s.dim0 - whole * s.rows;
    if (whole > 0) dst.narrow(0, 0, whole * s.rows).view({whole, s.rows, s.rest}).copy_(src.narrow(0, 0, whole));
    if (left > 0) dst.narrow(0, whole * s.rows, left).copy_(src.select(0, whole).narrow(0, 0, left));
  }
}

void FsdpUnit::queue_end_of_backward() {
  if (!group_ || group_->callback_queued) return;
  group_->callback_queued = true;
  std::weak_ptr<FsdpUnitGroup> weak = group_;
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    auto group = weak.lock();
    if (!group) return;
    group->callback_queued = false;
    for (auto* u : group->units) u->free();
  });
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

FsdpUnit* unit_in(AutogradContext* ctx) { return reinterpret_cast<FsdpUnit*>(ctx->saved_data["unit"].toInt()); }

// On the block's outputs: its backward runs before the block's backward nodes and gathers the unit.
struct GatherBeforeBackward : torch::autograd::Function<GatherBeforeBackward> {
  static variable_list forward(AutogradContext* ctx, int64_t unit, at::TensorList xs) {
    ctx->saved_data["unit"] = unit;
    return xs.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* unit = unit_in(ctx);
    unit->queue_end_of_backward();
    // The unit before it in the model runs its backward next: its all-gather is prefetched.
    if (unit->options().backward_gathers) unit->gather_and_prefetch(-1);
    variable_list out{torch::Tensor()};
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

// On the block's inputs: its backward runs once the block's backward has produced their gradients
// (and the parameters' gradient accumulators have run): the unit is freed.
struct FreeAfterBackward : torch::autograd::Function<FreeAfterBackward> {
  static variable_list forward(AutogradContext* ctx, int64_t unit, at::TensorList xs) {
    ctx->saved_data["unit"] = unit;
    return xs.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    unit_in(ctx)->free();
    variable_list out{torch::Tensor()};
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

// fn's tensors that need a gradient through the identity node F, put back in their places.
template <typename F>
std::vector<torch::Tensor> through(FsdpUnit& unit, std::vector<torch::Tensor> xs) {
  std::vector<size_t> at;
  std::vector<torch::Tensor> picked;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i].defined() && xs[i].requires_grad()) {
      at.push_back(i);
      picked.push_back(xs[i]);
    }
  }
  if (picked.empty()) return xs;
  auto out = F::apply(reinterpret_cast<int64_t>(&unit), at::TensorList(picked));
  for (size_t k = 0; k < at.size(); ++k) xs[at[k]] = out[k];
  return xs;
}

}  // namespace

std::vector<torch::Tensor> run_unit(FsdpUnit& unit, const std::vector<torch::Tensor>& inputs, const UnitFunction& fn) {
  if (!torch::GradMode::is_enabled()) {
    unit.gather_and_prefetch(+1);
    auto out = fn(inputs);
    unit.free();
    return out;
  }
  auto in = through<FreeAfterBackward>(unit, inputs);
  unit.gather_and_prefetch(+1);  // the next unit's all-gather runs while this one computes
  auto out = through<GatherBeforeBackward>(unit, fn(in));
  if (unit.options().reshard_after_forward) unit.free();
  return out;
}

}  // namespace strobe::distributed
