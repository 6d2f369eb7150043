// Fully sharded parameters (trainer.strategy: fsdp, docs/DISTRIBUTED.md): a unit's parameters live on
// each rank as 1/world of their rows and are gathered whole only while the unit runs.
//
// A unit is a group of a model's parameters that run together (a transformer block; the embedding;
// the final norm and the head). Each parameter is cut along dim 0 as zero2 cuts it (zero2.h): world
// chunks of ceil(dim0 / world) rows, rank r keeping chunk r, zero-padded; the rank's chunks of the
// unit's parameters lie end to end in one flat shard (the unit's shard, in the parameters' dtype).
//
// Gathered and freed. The unit's parameters keep their tensors (the module's parameters, their
// autograd identity, their gradient accumulators), but their data lives in one storage per unit
// that is allocated only while the unit is gathered:
//   gather()  one all-gather of the ranks' flat shards into a transient [world * S] buffer, the
//             storage allocated back to its whole size, and each parameter's rows copied out of the
//             buffer into it (as PyTorch FSDP2's all-gather copy-out);
//   free()    the storage resized to zero bytes in place (its data released to the allocator).
// Autograd's saved tensors (at::linear saves its weight) are the parameters themselves, so they see
// the storage come and go: a backward that needs them runs after the unit is gathered again. The
// copy-out writes through tensors of their own over the same storage, so the parameters' version
// counters do not move and autograd's check of saved tensors still holds.
//
// run_unit() is the unit's forward as an autograd composition (libtorch modules have no forward
// hooks; the unit is a pair of identity autograd nodes around the block's own graph):
//   forward   gather; the block runs; free unless the unit keeps its parameters for the backward
//             (reshard_after_forward false, with gradients on). With gradients off it always frees.
//   backward  an identity node on the block's outputs runs before any of the block's backward
//             nodes: it gathers the unit again (nothing to do when it was kept). An identity node on
//             the block's inputs runs after them (the engine runs a parameter's gradient accumulator
//             before any lower-priority node): the unit is freed. A unit whose inputs need no gradient
//             (the first one) is freed by a callback at the end of the backward, which every unit
//             still gathered then gets.
// With activation checkpointing (strobe/core/activation_checkpoint.h) the unit is outside and the
// checkpoint inside: the forward gathers, runs the block without keeping its graph, and frees; the
// backward gathers (the node on the outputs), recomputes the block and takes its gradients (the
// checkpoint's node), then frees (the node on the inputs). The models' blocks compose the two in
// run_model_block.
// Prefetch: when a unit gathers for its forward it issues the next unit's all-gather (the backward:
// the previous unit's) without waiting for it, so that on NCCL it runs on the communication stream
// while this unit computes; the next unit's gather() waits for it (the compute stream waits, the
// host does not). At most one unit's gather is in flight ahead of the one running.
// Each gather is an all-gather every rank issues in the same order (the units run in the same order
// on every rank), noted in the rank's record of collectives as `unit all-gather`.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>

#include "strobe/distributed/collective_record.h"

namespace c10d {
class ProcessGroup;
class Work;
}
namespace torch::nn {
class Module;
}

namespace strobe::distributed {

class FsdpUnit;

// What the units of one model share: the end-of-backward callback, queued once per backward.
struct FsdpUnitGroup {
  std::vector<FsdpUnit*> units;
  bool callback_queued = false;
};

struct FsdpUnitOptions {
  bool reshard_after_forward = true;  // free after the forward (gather again for the backward)
  // Never freed (the parameters of no block: a tied embedding and head, the final norm): gathered
  // from the start and gathered again by refresh() after each optimizer step.
  bool keep_gathered = false;
  // The unit's backward reads its parameters' values: gathered again for it. False for an embedding
  // (its weight's gradient needs the indices and the row count only): its backward runs on the
  // freed unit, and no prefetch of the backward gathers it.
  bool backward_gathers = true;
};

class FsdpUnit {
 public:
  // `params`: the unit's parameters (named, one dtype and device), whole and equal on every rank.
  // Keeps this rank's rows of each in the unit's shard and frees the whole values.
  FsdpUnit(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t rank, int64_t world, std::string name,
           std::vector<std::pair<std::string, torch::Tensor>> params, FsdpUnitOptions options,
           std::shared_ptr<FsdpUnitGroup> group, CollectiveRecord* record = nullptr);
  ~FsdpUnit();
  FsdpUnit(const FsdpUnit&) = delete;
  FsdpUnit& operator=(const FsdpUnit&) = delete;

  // Collective (every rank): the parameters whole. Nothing when they are. Waits for the all-gather
  // start_gather() issued, or issues it.
  void gather();
  // Collective: issues the all-gather (into a transient buffer) without waiting for it; gather()
  // finishes it. Nothing when the unit is gathered or its gather is in flight.
  void start_gather();
  // gather(), then start_gather() of the next unit of the group in `direction` (+1: the forward's
  // order, -1: the backward's) that is not kept gathered: its all-gather overlaps this unit's work.
  void gather_and_prefetch(int direction);
  bool in_flight() const { return in_flight_; }
  // The parameters' storage released (zero bytes). Nothing when it is, or for a unit kept gathered.
  void free();
  // Collective: a unit kept gathered takes its shard's new values (after the optimizer step).
  void refresh();
  bool gathered() const { return gathered_; }

  const std::string& name() const { return name_; }
  const FsdpUnitOptions& options() const { return options_; }
  const std::vector<torch::Tensor>& params() const { return params_; }
  const std::vector<std::string>& param_names() const { return names_; }
  // This rank's flat shard [S] (the parameters' dtype) and parameter i's rows in it [rows, ...]:
  // undefined once the unit takes its rows from sources.
  const torch::Tensor& shard() const { return shard_; }
  torch::Tensor shard_of(size_t i) const;
  // Under trainer.strategy fsdp the optimizer's fp32 shards are the rows' one copy: `sources[i]` is
  // parameter i's ([rows, ...], any floating dtype). Each gather casts them into a transient flat
  // buffer of the parameters' dtype, and the unit's own shard is released (2 bytes per parameter /
  // world under bf16-master).
  void set_shard_sources(std::vector<torch::Tensor> sources);
  bool has_sources() const { return !sources_.empty(); }
  // Rows of each parameter per rank (ceil(dim0 / world)).
  int64_t rows(size_t i) const { return slots_[i].rows; }
  // Bytes the gathered parameters take (the unit's storage while gathered).
  int64_t gathered_bytes() const { return static_cast<int64_t>(full_bytes_); }
  // The end of a backward: frees every unit of the group still gathered (the engine's callback).
  void queue_end_of_backward();

 private:
  struct Slot {
    int64_t dim0 = 1, rest = 1, rows = 1;
    int64_t shard_offset = 0;  // in the flat shard, elements
    int64_t full_offset = 0;   // in the unit's storage, elements
  };
  void resize_storage(size_t bytes);
  FsdpUnit* neighbour(int step) const;

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int64_t rank_, world_;
  std::string name_;
  FsdpUnitOptions options_;
  std::shared_ptr<FsdpUnitGroup> group_;
  CollectiveRecord* record_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> writers_;  // the parameters' views of the storage, with their own version counters
  std::vector<Slot> slots_;
  c10::Storage storage_;  // the gathered parameters, end to end; zero bytes while freed
  size_t full_bytes_ = 0;
  int64_t sharded_numel_ = 0;
  torch::TensorOptions options_of_params_;
  torch::Tensor shard_;
  bool gathered_ = true;
  bool in_flight_ = false;  // start_gather() issued, gather() not yet
  torch::Tensor recv_, send_;
  std::vector<torch::Tensor> sources_;
  c10::intrusive_ptr<c10d::Work> work_;
};

// A block that is a unit of its own (Strategy::shard_model): the module its run_block runs, and its
// parameters under their names in the model.
struct FsdpBlock {
  std::shared_ptr<torch::nn::Module> module;
  std::vector<std::pair<std::string, torch::Tensor>> params;
};

using UnitFunction = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

// The unit a model's block runs in (the models' run_block finds it here): attached when the
// strategy makes the units, detached when the unit goes. Null for a block of no unit.
void attach_unit(const torch::nn::Module& block, FsdpUnit* unit);
FsdpUnit* unit_of(const torch::nn::Module& block);

// fn(inputs) for the unit's block, its parameters gathered for the forward and again for the
// backward (see above). Inputs may be undefined tensors.
std::vector<torch::Tensor> run_unit(FsdpUnit& unit, const std::vector<torch::Tensor>& inputs, const UnitFunction& fn);

}  // namespace strobe::distributed
