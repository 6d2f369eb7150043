// NaN captures on disk, and their replay.
//
// A capture is a directory `<run_dir>/nan/step_<N>/` written atomically (built as a temporary
// directory, then renamed) by the nan_capture callback:
//   capture.ckpt  a full checkpoint (checkpoint_io format) of the failing step's start: model weights
//                 and buffers from before the step, optimizer, scheduler and scaler state, loop
//                 counters, every RNG state; plus "capture/batch/<i>/<key>" tensors (the step's
//                 micro-batches as they left the loader) and the "capture" blob (JSON: step, epoch,
//                 batch indices, batch meta, loss bits, which checks fired, non-finite gradients)
//   config.yaml   the resolved config
//   summary.txt   a short human summary
// `strobe replay` rebuilds the experiment from it and re-runs the step (runner/replay.h); this part,
// the files of a capture, is what the nan_capture callback needs.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "strobe/data/batch.h"

namespace strobe {

namespace checkpoint {
struct CheckpointData;
}

namespace capture {

constexpr const char* kCheckpointFile = "capture.ckpt";

void put_batches(checkpoint::CheckpointData& out, const std::vector<Batch>& batches);
std::vector<Batch> get_batches(const checkpoint::CheckpointData& in);

// The capture directory `path` names: the directory itself when it holds capture.ckpt, else the
// latest step_<N> inside it (a run's nan/). Throws checkpoint::CheckpointError naming the path.
std::string resolve_capture_dir(const std::string& path);

// What a capture killed while it was written (kill -9) leaves in `base` (a nan/ directory, or its
// rank<r>/): its temporary `.step_<N>.tmp.<pid>/` of a process no longer running, and the empty
// `step_<N>/` it had claimed (only when no live writer has a temporary there). Removed at the next
// fit's setup; returns the names removed. A whole capture is never touched.
std::vector<std::string> remove_capture_leftovers(const std::string& base);

// Hex of a tensor's raw bytes (exact loss comparison across processes and devices).
std::string tensor_bits(const torch::Tensor& t);

}  // namespace capture
}  // namespace strobe
