// Deterministic crash points, for tests of what a kill -9 or an exception leaves behind.
//
// STROBE_FAULT_AT=<point>@<step> makes the process SIGKILL itself the first time it reaches <point>
// with the trainer's global step equal to <step>: exactly what `kill -9` does, at an exact place
// instead of after a sleep. Points at the end of a training step, in order (docs/ARCHITECTURE.md,
// "The end of a step"): before_validation, before_checkpoint, after_topk (model_checkpoint: the
// top-k file written, last.ckpt not yet), after_checkpoint. Inside a step: after_backward (the eager
// step's backward done, its update not applied; <step> is that step's number, global step + 1).
// A checkpoint under trainer.strategy zero2 (docs/DISTRIBUTED.md): zero2_shard_written (this rank's
// optimizer shard written, the checkpoint file not yet), zero2_file_written (rank 0: the file
// written, the earlier saves' shard folders not yet removed); zero2_recut (a resume re-cutting a
// zero2 checkpoint's optimizer shards: the first shard file read; <step> is the checkpoint's).
// STROBE_FAULT_AT=throw:<point>@<step> throws a std::runtime_error there instead ("fault point
// <point> at step <step> (STROBE_FAULT_AT)"): an error inside training, as a failing op would raise.
// Unset (always, outside tests): nothing.
#pragma once

#include <cstdint>

namespace strobe {

void fault_point(const char* point, int64_t step);

}  // namespace strobe
