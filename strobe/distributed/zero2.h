// ZeRO-2 (trainer.strategy: zero2, docs/DISTRIBUTED.md): the optimizer's fp32 values, its moments
// and the reduced gradients are sharded across the ranks; every rank keeps the whole model (in its
// training dtype) for the forward and the backward.
//
// Sharding, as PyTorch's FSDP2 does it: each parameter is cut along dim 0 into world_size chunks of
// ceil(dim0 / world_size) rows (a 0-d parameter counts as one row); rank r owns chunk r, zero-padded
// to that many rows. So each rank's optimizer holds one fp32 tensor per parameter, under the
// parameter's name, with the parameter's trailing shape: parameter groups, per-parameter norms and
// the fused optimizer's tensor lists keep working on the shards. Padding rows hold zeros, get zero
// gradients and stay zero under SGD, Adam and AdamW.
//
// One optimizer step:
//   backward     gradient-accumulator post hooks (as c10d::Reducer's): on a step's last micro-batch
//                each parameter's accumulated gradient is copied into its bucket's flat input as
//                it becomes ready and the full gradient is released; complete buckets are
//                reduce-scattered (ReduceOp::AVG) in bucket order (the same collectives in the
//                same order on every rank), while backward goes on. An engine
//                callback at the end of backward launches what is left and waits for every bucket
//                (Work::wait: on CUDA the current stream waits, the host does not).
//   finish()     each shard's .grad is its slice of its bucket's output (the mean over ranks).
//   norms        per-parameter squared norms of the local shards, all-reduced (SUM): every rank
//                gets every parameter's global norm (clipping, the non-finite flag, forensics).
//   the step     the optimizer updates the local shards only.
//   gather_params()  the updated shards, in the model's dtype, all-gathered bucket by bucket
//                (the next bucket's all-gather is in flight while the previous one is copied out)
//                into every rank's parameters.
// Micro-batches before a step's last one keep their gradients locally (as DDP's no_sync).
// Bucket memory: the reduce-scatter inputs exist only while their bucket is in flight; the outputs
// (the gradient shards, 1/N of the gradients) are kept.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>

#include "strobe/distributed/collective_record.h"

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d
namespace torch::autograd {
struct Node;
}

namespace strobe::distributed {

class FsdpUnit;

struct ShardedParam {
  std::string name;
  torch::Tensor param;   // the model's parameter (its training dtype: bf16 under bf16-master)
  torch::Tensor master;  // its fp32 value (the parameter itself when that is fp32)
};

class Zero2Shards {
 public:
  // Cuts every parameter's fp32 value into this rank's shard. The parameters must be equal across
  // ranks (Strategy::setup_model broadcast them); `master`s are broadcast from rank 0 here.
  // `record` (when given) is told of every collective these shards issue (collective_record.h).
  Zero2Shards(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t rank, int64_t world, std::vector<ShardedParam> params,
              int64_t bucket_bytes, CollectiveRecord* record = nullptr);
  ~Zero2Shards();
  Zero2Shards(const Zero2Shards&) = delete;
  Zero2Shards& operator=(const Zero2Shards&) = delete;

  // What the optimizer updates: one fp32 tensor per parameter, in the constructor's order.
  const std::vector<torch::Tensor>& shards() const { return shards_; }
  const std::vector<std::string>& names() const { return names_; }
  // The model's parameters, whole (shard i is cut from params()[i]).
  const std::vector<torch::Tensor>& params() const { return params_; }

  // Hooks on the parameters that require gradients now (again after an unfreeze).
  void install_hooks();
  // The next backward reduce-scatters (a step's last micro-batch).
  void prepare_for_backward();
  // After that backward: every shard whose parameter got a gradient has its .grad (the mean over
  // ranks, in the parameters' dtype); no parameter keeps a .grad. Idempotent.
  void finish();

  // The all-gather of the updated shards into the parameters.
  void gather_params();
  // Drops the shards' gradients (their storage, the bucket outputs, is kept).
  void release_grads();

  // trainer.strategy fsdp (fsdp.h): the parameters live in `units` (model order), which cut them the
  // same way. Every parameter must be in exactly one unit. From then on a bucket is a unit (reduced
  // in reverse model order, as the backward finishes the units), gather_params() copies each updated
  // shard into its unit's shard in the parameters' dtype without a collective (the unit's next
  // gather brings it whole), and load_full_value writes the unit's shard, not the parameter. The
  // units' shards are set from the fp32 shards here.
  void bind_units(const std::vector<FsdpUnit*>& units);
  bool fully_sharded() const { return !unit_slots_.empty(); }
  // fsdp, collective: the units kept gathered take their shards' values (after load_full_value).
  void refresh_kept_units();

  // Collective (every rank, same order): parameter i's whole fp32 value.
  torch::Tensor full_value(size_t i) { return full_value(i, shards_[i]); }
  // Collective: the whole tensor whose rows on this rank are `rows` (shaped and cut as shards()[i]:
  // a weight average kept per shard, for instance).
  torch::Tensor full_value(size_t i, const torch::Tensor& rows);
  // This rank's rows of a whole tensor of parameter i's shape, cut as shards()[i] (padding zero).
  torch::Tensor rows_of(size_t i, const torch::Tensor& full) const;
  // Parameter i from its whole fp32 value: this rank's shard (padding zeroed) and the parameter.
  void load_full_value(size_t i, const torch::Tensor& full);

 private:
  struct Slot {
    size_t bucket = 0;
    int64_t dim0 = 1, rest = 1, rows = 1;  // rows per rank (chunk height)
    int64_t offset = 0;                    // in the bucket's shard
    bool hooked = false, ready = false;
    uintptr_t hook_key = 0;
    std::shared_ptr<torch::autograd::Node> accumulator;
  };
  struct Bucket {
    std::vector<size_t> params;
    int64_t shard_numel = 0;
    c10::ScalarType dtype;
    torch::Tensor input, output;  // [world * shard_numel] while in flight; [shard_numel] kept
    c10::intrusive_ptr<c10d::Work> work;
    int64_t pending = 0;
  };

  void on_grad_ready(size_t i);
  void launch(size_t b);
  void launch_ready_buckets();
  void finalize_backward();
  torch::Tensor chunked_view(const torch::Tensor& flat, size_t i) const;  // [world, rows, rest] of flat [world, S]
  void copy_rows_in(const torch::Tensor& dst3, const torch::Tensor& full, size_t i) const;
  void copy_rows_out(torch::Tensor& full, const torch::Tensor& src3, size_t i) const;
  void cut_rows(size_t i, const torch::Tensor& full, torch::Tensor& rows) const;  // this rank's rows of full, padding zero

  int64_t note(CollectiveKind kind, int64_t bytes) { return record_ ? record_->issue(kind, bytes) : 0; }
  void noted_return(int64_t seq) {
    if (record_ && seq) record_->returned(seq);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int64_t rank_, world_;
  CollectiveRecord* record_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_, shards_;
  std::vector<Slot> slots_;
  std::vector<std::pair<FsdpUnit*, size_t>> unit_slots_;  // fsdp: parameter i is unit.params()[j]
  std::vector<FsdpUnit*> units_;                           // fsdp: the units, in model order
  void publish(size_t i);  // fsdp: shard i into its unit's shard
  std::vector<Bucket> buckets_;
  size_t next_bucket_ = 0;     // the next bucket to launch (buckets are launched in order)
  std::optional<size_t> in_flight_;  // the latest launched bucket, its input still held
  bool expecting_ = false;     // this backward reduce-scatters
  bool callback_queued_ = false;
};

}  // namespace strobe::distributed
