#include "strobe/distributed/zero2.h"

#include "strobe/distributed/fsdp.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/torch.h>

namespace strobe::distributed {

namespace {
constexpr size_t kBroadcastBytes = 250 * 1024 * 1024;
}

Zero2Shards::Zero2Shards(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t rank, int64_t world,
                         std::vector<ShardedParam> params, int64_t bucket_bytes, CollectiveRecord* record)
    : pg_(std::move(pg)), rank_(rank), world_(world), record_(record) {
  TORCH_CHECK(!params.empty(), "zero2: the model has no trainable parameters");
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> masters;
  for (auto& p : params) {
    TORCH_CHECK(p.master.scalar_type() == torch::kFloat32, "zero2: ", p.name, "'s master value is not fp32");
    names_.push_back(p.name);
    params_.push_back(p.param);
    masters.push_back(p.master);
  }
  slots_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& m = masters[i];
    Slot& s = slots_[i];
    s.dim0 = m.dim() > 0 ? m.size(0) : 1;
    s.rest = s.dim0 > 0 ? m.numel() / s.dim0 : 0;
    s.rows = (s.dim0 + world_ - 1) / world_;
    std::vector<int64_t> shape{s.rows};
    for (int64_t d = 1; d < m.dim(); ++d) shape.push_back(m.size(d));
    // On the parameter's device, wherever the master is (the host under the host-side build).
    shards_.push_back(torch::zeros(shape, params_[i].options().dtype(torch::kFloat32)));
  }
  // The optimizer's values start equal on every rank, whatever each rank's initialization was: rank
  // 0's masters are broadcast (a master that is its parameter, fp32 training, came with
  // setup_model's broadcast already) and each rank keeps its rows. A master on the host passes
  // through the device a bucket at a time (kBroadcastBytes, or one larger parameter), so the GPU
  // never holds more of the fp32 model than that beside the shards.
  std::vector<size_t> pending;
  int64_t pending_bytes = 0;
  auto flush = [&] {
    std::vector<torch::Tensor> on_device;
    for (size_t i : pending) on_device.push_back(masters[i].to(params_[i].device()));
    if (!on_device.empty()) {
      const int64_t seq = note(CollectiveKind::kMasterBroadcast, pending_bytes);
      c10d::broadcast_coalesced(pg_, on_device, kBroadcastBytes, 0);
      noted_return(seq);
    }
    for (size_t k = 0; k < pending.size(); ++k) load_full_value(pending[k], on_device[k]);
    pending.clear();
    pending_bytes = 0;
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    if (masters[i].is_same(params_[i])) {
      load_full_value(i, masters[i]);
      continue;
    }
    const int64_t bytes = static_cast<int64_t>(masters[i].nbytes());
    if (!pending.empty() && pending_bytes + bytes > static_cast<int64_t>(kBroadcastBytes)) flush();
    pending.push_back(i);
    pending_bytes += bytes;
  }
  flush();
  // Buckets in reverse model order (roughly the order backward produces gradients), one dtype each,
  // closed when the next parameter's whole gradient would pass bucket_bytes.
  int64_t bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto dtype = params_[k].scalar_type();
    const int64_t nbytes = params_[k].numel() * static_cast<int64_t>(c10::elementSize(dtype));
    if (buckets_.empty() || buckets_.back().dtype != dtype || (bytes > 0 && bytes + nbytes > bucket_bytes)) {
      buckets_.push_back(Bucket{});
      buckets_.back().dtype = dtype;
      bytes = 0;
    }
    Bucket& b = buckets_.back();
    Slot& s = slots_[k];
    s.bucket = buckets_.size() - 1;
    s.offset = b.shard_numel;
    b.shard_numel += s.rows * s.rest;
    b.params.push_back(k);
    bytes += nbytes;
  }
  install_hooks();
}

Zero2Shards::~Zero2Shards() {
  for (auto& s : slots_)
    if (s.accumulator) s.accumulator->del_post_hook(s.hook_key);
}

void Zero2Shards::install_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    Slot& s = slots_[i];
    if (s.hooked || !params_[i].requires_grad()) continue;
    s.accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    s.hook_key = s.accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          on_grad_ready(i);
          return outputs;
        }));
    s.hooked = true;
  }
}

void Zero2Shards::prepare_for_backward() {
  TORCH_CHECK(!expecting_, "zero2: a step's last backward began before the previous one's gradients were reduced");
  for (auto& b : buckets_) {
    b.pending = 0;
    for (size_t i : b.params)
      if (slots_[i].hooked && params_[i].requires_grad()) ++b.pending;
  }
  for (auto& s : slots_) s.ready = false;
  next_bucket_ = 0;
  in_flight_.reset();
  expecting_ = true;
  callback_queued_ = false;
}

torch::Tensor Zero2Shards::chunked_view(const torch::Tensor& flat, size_t i) const {
  const Slot& s = slots_[i];
  const Bucket& b = buckets_[s.bucket];
  return flat.view({world_, b.shard_numel}).narrow(1, s.offset, s.rows * s.rest).view({world_, s.rows, s.rest});
}

void Zero2Shards::copy_rows_in(const torch::Tensor& dst3, const torch::Tensor& full, size_t i) const {
  // Rank r's chunk is rows [r * rows, (r + 1) * rows) of the parameter; what lies past dim0 stays
  // the zero padding dst3 was made with.
  const Slot& s = slots_[i];
  if (s.rows == 0 || s.rest == 0) return;
  auto src = full.reshape({s.dim0, s.rest});
  const int64_t whole = s.dim0 / s.rows, rem = s.dim0 - whole * s.rows;
  if (whole > 0) dst3.narrow(0, 0, whole).copy_(src.narrow(0, 0, whole * s.rows).view({whole, s.rows, s.rest}));
  if (rem > 0) dst3.select(0, whole).narrow(0, 0, rem).copy_(src.narrow(0, whole * s.rows, rem));
}

void Zero2Shards::copy_rows_out(torch::Tensor& full, const torch::Tensor& src3, size_t i) const {
  const Slot& s = slots_[i];
  if (s.rows == 0 || s.rest == 0) return;
  full.copy_(src3.reshape({world_ * s.rows, s.rest}).narrow(0, 0, s.dim0).view(full.sizes()));
}

void Zero2Shards::on_grad_ready(size_t i) {
  if (!expecting_) return;  // a micro-batch before the step's last: the gradient accumulates locally
  Slot& s = slots_[i];
  Bucket& b = buckets_[s.bucket];
  TORCH_CHECK(!s.ready, "zero2: ", names_[i], " received its gradient twice in one backward");
  if (!callback_queued_) {
    // As c10d::Reducer: the end of this backward waits for every bucket.
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
    callback_queued_ = true;
  }
  torch::NoGradGuard ng;
  const auto& g = params_[i].grad();
  TORCH_CHECK(g.defined(), "zero2: ", names_[i], "'s gradient hook ran without a gradient");
  if (!b.input.defined()) b.input = torch::zeros({world_ * b.shard_numel}, g.options().dtype(b.dtype));
  copy_rows_in(chunked_view(b.input, i), g, i);
  params_[i].mutable_grad() = torch::Tensor();  // the full gradient is not kept: its reduced shard is
  s.ready = true;
  --b.pending;
  launch_ready_buckets();
}

void Zero2Shards::launch_ready_buckets() {
  // In bucket order, as c10d::Reducer does: every rank must issue the same collectives in the same
  // order, whatever order its backward finished the buckets in. A bucket with nothing to reduce
  // (all its parameters frozen) is passed over alike on every rank.
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& b = buckets_[next_bucket_];
    bool any = false;
    for (size_t i : b.params) any |= slots_[i].ready;
    if (any) launch(next_bucket_);
    ++next_bucket_;
  }
}

void Zero2Shards::launch(size_t k) {
  Bucket& b = buckets_[k];
  if (!b.input.defined()) b.input = torch::zeros({world_ * b.shard_numel}, params_[b.params[0]].options().dtype(b.dtype));
  if (!b.output.defined()) b.output = torch::empty({b.shard_numel}, b.input.options());
  c10d::ReduceScatterOptions o;
  o.reduceOp = c10d::ReduceOp::AVG;
  if (record_ && record_->skips(CollectiveKind::kReduceScatter, rank_)) {
    // Tests only (CollectiveRecord::skips): this rank leaves the bucket's reduce-scatter out.
    auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    fut->markCompleted(c10::IValue(std::vector<torch::Tensor>{b.output}));
    b.work = c10d::Work::create_from_future(fut);
  } else {
    const int64_t seq = note(CollectiveKind::kReduceScatter, static_cast<int64_t>(b.input.nbytes()));
    b.work = pg_->_reduce_scatter_base(b.output, b.input, o);
    noted_return(seq);
  }
  // A bounded footprint: the bucket launched before this one is waited for (on CUDA the current
  // stream waits; the host does not) and its input freed, while this one is in flight.
  if (in_flight_) {
    Bucket& prev = buckets_[*in_flight_];
    prev.work->wait();
    prev.work.reset();
    prev.input = torch::Tensor();
  }
  in_flight_ = k;
}

void Zero2Shards::finalize_backward() {
  if (!expecting_) return;
  std::vector<std::string> missing;
  for (auto& b : buckets_)
    if (b.pending > 0)
      for (size_t i : b.params)
        if (slots_[i].hooked && params_[i].requires_grad() && !slots_[i].ready) missing.push_back(names_[i]);
  expecting_ = false;
  callback_queued_ = false;
  if (!missing.empty()) {
    for (auto& b : buckets_) b.input = torch::Tensor(), b.work.reset();
    throw std::runtime_error(fmt::format(
        "zero2: these parameters require gradients but received none in the step's last backward: {} (every rank must "
        "reduce every gradient; freeze them or use them)",
        fmt::join(missing, ", ")));
  }
  launch_ready_buckets();
  for (auto& b : buckets_) {
    if (b.work) b.work->wait();
    b.work.reset();
    b.input = torch::Tensor();
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const Slot& s = slots_[i];
    if (!s.ready) continue;
    // Its slice of the bucket's output, as a tensor of its own over that storage rather than an
    // autograd view, so the optimizer's zero_grad may detach and drop it.
    const auto& out = buckets_[s.bucket].output;
    auto g = torch::empty({0}, out.options());
    g.set_(out.storage(), out.storage_offset() + s.offset, shards_[i].sizes(), shards_[i].strides());
    shards_[i].mutable_grad() = g;
  }
}

void Zero2Shards::finish() {
  if (expecting_) finalize_backward();  // a backward that reached no hooked parameter
}

void Zero2Shards::release_grads() {
  for (auto& s : shards_) s.mutable_grad() = torch::Tensor();
}

void Zero2Shards::bind_units(const std::vector<FsdpUnit*>& units) {
  TORCH_CHECK(!expecting_, "zero2: bind_units during a backward");
  std::vector<std::pair<FsdpUnit*, size_t>> where(params_.size(), {nullptr, 0});
  std::vector<std::vector<size_t>> groups;
  for (auto* u : units) {
    groups.emplace_back();
    for (size_t j = 0; j < u->params().size(); ++j) {
      size_t i = 0;
      while (i < params_.size() && !params_[i].is_same(u->params()[j])) ++i;
      if (i == params_.size()) continue;  // a frozen parameter: the optimizer has no shard of it
      TORCH_CHECK(!where[i].first, "fsdp: ", names_[i], " is in two units (", where[i].first->name(), ", ", u->name(), ")");
      TORCH_CHECK(slots_[i].rows == u->rows(j), "fsdp: ", names_[i], " is cut differently by its unit");
      where[i] = {u, j};
      groups.back().push_back(i);
    }
  }
  for (size_t i = 0; i < params_.size(); ++i)
    TORCH_CHECK(where[i].first, "fsdp: ", names_[i], " is in no unit");
  unit_slots_ = std::move(where);
  units_ = units;
  // One bucket per unit, the last unit's first: the order the backward finishes them in.
  buckets_.clear();
  for (size_t k = groups.size(); k-- > 0;) {
    if (groups[k].empty()) continue;
    Bucket b;
    b.dtype = params_[groups[k][0]].scalar_type();
    for (size_t i : groups[k]) {
      TORCH_CHECK(params_[i].scalar_type() == b.dtype, "fsdp: unit ", unit_slots_[i].first->name(), " mixes dtypes");
      slots_[i].bucket = buckets_.size();
      slots_[i].offset = b.shard_numel;
      b.shard_numel += slots_[i].rows * slots_[i].rest;
      b.params.push_back(i);
    }
    buckets_.push_back(std::move(b));
  }
  torch::NoGradGuard ng;
  // A unit whose every parameter has a shard here takes its rows from the shards at each gather
  // and keeps no copy of its own; one holding a frozen parameter keeps its shard, refreshed from ours.
  for (size_t k = 0; k < units.size(); ++k) {
    std::vector<torch::Tensor> sources(units[k]->params().size());
    for (size_t i = 0; i < params_.size(); ++i)
      if (unit_slots_[i].first == units[k]) sources[unit_slots_[i].second] = shards_[i];
    if (std::all_of(sources.begin(), sources.end(), [](const torch::Tensor& t) { return t.defined(); }))
      units[k]->set_shard_sources(std::move(sources));
  }
  for (size_t i = 0; i < params_.size(); ++i) publish(i);
  refresh_kept_units();
}

void Zero2Shards::refresh_kept_units() {
  // In the units' order, the same on every rank (each refresh is an all-gather).
  for (auto* u : units_)
    if (u->options().keep_gathered) u->refresh();
}

void Zero2Shards::publish(size_t i) {
  auto [unit, j] = unit_slots_[i];
  if (!unit->has_sources()) unit->shard_of(j).copy_(shards_[i]);
}

void Zero2Shards::gather_params() {
  torch::NoGradGuard ng;
  if (fully_sharded()) {
    // The units gather from the updated shards (their sources); one keeping its own shard takes ours.
    for (size_t i = 0; i < params_.size(); ++i) publish(i);
    refresh_kept_units();
    return;
  }
  struct InFlight {
    size_t bucket;
    torch::Tensor recv;
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::optional<InFlight> prev;
  auto land = [&](InFlight& f) {
    f.work->wait();
    for (size_t i : buckets_[f.bucket].params) copy_rows_out(params_[i], chunked_view(f.recv, i), i);
  };
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const Bucket& b = buckets_[k];
    auto send = torch::empty({b.shard_numel}, shards_[b.params[0]].options().dtype(b.dtype));
    std::vector<torch::Tensor> dst, src;
    for (size_t i : b.params) {
      const Slot& s = slots_[i];
      dst.push_back(send.narrow(0, s.offset, s.rows * s.rest).view(shards_[i].sizes()));
      src.push_back(shards_[i]);
    }
    at::_foreach_copy_(dst, src);
    auto recv = torch::empty({world_ * b.shard_numel}, send.options());
    const int64_t seq = note(CollectiveKind::kAllGather, static_cast<int64_t>(recv.nbytes()));
    auto work = pg_->_allgather_base(recv, send);
    noted_return(seq);
    if (prev) land(*prev);
    prev = InFlight{k, recv, work};
  }
  if (prev) land(*prev);
}

torch::Tensor Zero2Shards::full_value(size_t i, const torch::Tensor& rows) {
  torch::NoGradGuard ng;
  const Slot& s = slots_[i];
  TORCH_CHECK(rows.sizes() == shards_[i].sizes(), "zero2: the rows of ", names_[i], " have shape ", shards_[i].sizes(),
              ", not ", rows.sizes());
  auto send = rows.contiguous().view({-1});
  auto recv = torch::empty({world_ * send.numel()}, send.options());
  const int64_t seq = note(CollectiveKind::kParamGather, static_cast<int64_t>(recv.nbytes()));
  pg_->_allgather_base(recv, send)->wait();
  noted_return(seq);
  auto full = torch::empty(params_[i].sizes(), recv.options());
  if (s.rows > 0 && s.rest > 0) full.view({s.dim0, s.rest}).copy_(recv.view({world_ * s.rows, s.rest}).narrow(0, 0, s.dim0));
  return full;
}

void Zero2Shards::cut_rows(size_t i, const torch::Tensor& full, torch::Tensor& rows) const {
  const Slot& s = slots_[i];
  TORCH_CHECK(full.sizes() == params_[i].sizes(), "zero2: ", names_[i], " has shape ", params_[i].sizes(), ", not ",
              full.sizes());
  rows.zero_();
  const int64_t start = std::min(rank_ * s.rows, s.dim0);
  const int64_t n = std::min(s.rows, s.dim0 - start);
  if (n > 0 && s.rest > 0)
    rows.view({s.rows, s.rest}).narrow(0, 0, n).copy_(full.reshape({s.dim0, s.rest}).narrow(0, start, n));
}

torch::Tensor Zero2Shards::rows_of(size_t i, const torch::Tensor& full) const {
  torch::NoGradGuard ng;
  auto rows = torch::empty(shards_[i].sizes(), shards_[i].options().dtype(full.scalar_type()));
  cut_rows(i, full, rows);
  return rows;
}

void Zero2Shards::load_full_value(size_t i, const torch::Tensor& full) {
  torch::NoGradGuard ng;
  cut_rows(i, full, shards_[i]);
  if (fully_sharded())
    publish(i);
  else if (!full.is_same(params_[i]))
    params_[i].copy_(full);
}

}  // namespace strobe::distributed
