// A checkpoint whose optimizer state is sharded over the ranks (trainer.strategy zero2; the layout
// in docs/DISTRIBUTED.md, "Checkpoints under zero2"): the Trainer's state is gathered as for any
// checkpoint, then this object writes and reads the files. Every rank writes its optimizer shard to
// <file>.zero2/<tag>/rank<r>.ckpt; once all have, rank 0 writes <file> (the whole model's fp32
// values and everything else) with a manifest naming the shard files, then removes the shard folders
// of the file's earlier saves. A kill at any point leaves <file> whole with its shards present.
// A resume reads the manifest and this rank's shard into the checkpoint's optimizer entry, re-cut
// for another number of processes or another strategy when the run has them.
//
// It holds the layout's names (the manifest and shard blobs, the folder) and talks to the other
// ranks through the strategy only (the tag's broadcast, the barrier, an orderly end before a refusal
// every rank reaches alike); other sharded layouts join here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "strobe/checkpoint/checkpoint_io.h"

namespace strobe {

namespace distributed {
class Strategy;
}

class ShardedCheckpoint {
 public:
  static constexpr const char* kManifestBlob = "zero2";      // rank 0's file: world size, tag, shard files
  static constexpr const char* kShardBlob = "zero2_shard";   // a rank's shard: its rank, world size (and tag)
  static constexpr const char* kFolderSuffix = checkpoint::kShardFolderSuffix;

  // `strategy` outlives this object; `sharded`: its optimizer state is sharded (zero2).
  ShardedCheckpoint(distributed::Strategy& strategy, bool sharded) : strategy_(strategy), sharded_(sharded) {}

  bool sharded() const { return sharded_; }

  // A checkpoint just gathered on this rank: when sharded, its optimizer entry is marked as this
  // rank's shard (what a callback sees, and what a rank's own file such as a capture records).
  void mark(checkpoint::CheckpointData& d) const;

  // Writes `d` to `path`: sharded, every rank takes part (the layout above; `global_step` names the
  // tag and the fault points); otherwise rank 0 writes the one file.
  void save(const std::string& path, checkpoint::CheckpointData d, int64_t global_step) const;

  // The whole shape of each optimizer parameter, by group and position (what a re-cut needs).
  using OptimizerShapes = std::vector<std::vector<std::vector<int64_t>>>;

  // The checkpoint a resume restores on this rank, when it is not `d` itself (nullopt: restore `d`):
  // `d` with this rank's optimizer state in its optimizer entry. Sharded on the same number of
  // processes: this rank's shard file, as the manifest names it. Otherwise re-cut on the host
  // (optimizer_reshard.h): a manifest's W shards for this run's W' ranks, or into a whole state
  // (ddp, one process); a whole state into this rank's shard. A malformed manifest, a missing shard
  // file, one that is not the manifest's or a state that does not fit this optimizer is refused with
  // one line (CheckpointError) on every rank alike, after an orderly end of the job. One process
  // replaying a sharded rank's own file (a capture): its optimizer entry is emptied (fresh moments),
  // said on stderr.
  std::optional<checkpoint::CheckpointData> for_resume(const checkpoint::CheckpointData& d, const OptimizerShapes& shapes) const;

 private:
  checkpoint::CheckpointData with_own_shard(const checkpoint::CheckpointData& d, const OptimizerShapes& shapes) const;

  distributed::Strategy& strategy_;
  bool sharded_;
};

}  // namespace strobe
