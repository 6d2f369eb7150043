// An optimizer's saved state, re-cut on the host for another sharding of its parameters
// (docs/DISTRIBUTED.md, "Resuming on another number of processes"): zero2's row shards of W
// processes into those of W' processes, into a whole state (ddp, one process), or a whole state into
// shards.
//
// The state is the archive torch::optim::serialize writes (every optimizer Strobe builds: AdamW,
// Adam, SGD, fused or not): per parameter, its state's fields; per group, its options and the keys of
// its parameters. A parameter is known by its position in its group, which is the same on both sides
// (the same optimizer config over the same model: a resume refuses anything else). A field whose
// shape is the parameter's slice (its rows on that side) is per row and is re-cut; any other field
// (a step count) is copied from the first source.
//
// zero2's cut (strobe/distributed/zero2.h): dim 0 into chunks of ceil(dim0 / W) rows, rank r owning
// chunk r zero-padded to that height; a 0-d parameter is one row. The padding rows of a source are
// dropped and the target's are made anew (zeros).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace strobe {

struct OptimizerSharding {
  int64_t world = 1;     // the number of shards (1 for a whole state)
  bool sharded = false;  // false: whole (each field has its parameter's shape)
};

// The archive (bytes of torch::serialize::OutputArchive::save_to) of rank `to_rank`'s optimizer
// under `to`, from the `from.world` archives of `from` (`read_source(k)`: the k-th one's bytes, read
// one at a time, so a rank holds one source's state beside its own result). `shapes[g][j]`: the whole
// shape of group g's j-th parameter. A source that does not fit (other groups, a field of another
// shape) throws std::runtime_error naming `what(k)` (the k-th source, for the message).
std::string reshard_optimizer_state(const std::vector<std::vector<std::vector<int64_t>>>& shapes, const OptimizerSharding& from,
                                    const std::function<std::string(int64_t)>& read_source, const OptimizerSharding& to,
                                    int64_t to_rank, const std::function<std::string(int64_t)>& what);

}  // namespace strobe
