// What a checkpoint records of the training loop: its counters (TrainerState, the "loop" blob), this
// process's random generators, and a step's start (StepStart) — the state NaN capture asks the
// checkpoint connector to record instead of the live one, so a capture holds the failing step's start.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

namespace strobe {

// Exit status of a run (fit() returns it; request_stop takes it): CONFIG.md's codes.
enum ExitCode : int { kExitOk = 0, kExitFailure = 1, kExitUsage = 2, kExitNaN = 3, kExitSigint = 130, kExitSigterm = 143 };

struct TrainerState {
  int64_t epoch = 0;             // current (0-based) epoch
  int64_t global_step = 0;       // optimizer steps taken
  int64_t batch_in_epoch = 0;    // training batches of this epoch already consumed
  int64_t batches_seen = 0;      // training batches consumed in the whole run
  int64_t val_runs = 0;          // validation runs completed
  bool epoch_done = false;       // the current epoch's batches are all consumed
  double elapsed_s = 0.0;        // training wall time before this process (max_time)
  // Samples of the epoch's order (all processes together) consumed before this epoch's batch 0: not
  // 0 after a resume that changed the batch (data.batch_size x processes) mid-epoch, which goes on
  // from the samples the checkpoint's run consumed, split by the new batch (docs/CONFIG.md, resume).
  int64_t sample_offset = 0;
};

// TrainerState as the checkpoint's "loop" blob (portable binary, the fields in the order above), and back;
// a blob written before sample_offset existed reads as 0.
std::string serialize_loop_state(const TrainerState& state);
TrainerState parse_loop_state(const std::string& blob);

// This process's generators: the CPU's, and every visible CUDA device's (index, state) when `cuda`.
struct RngSnapshot {
  torch::Tensor cpu;
  std::vector<std::pair<int, torch::Tensor>> cuda;
};
RngSnapshot snapshot_rng(bool cuda);

// The start of a training step, recorded by whoever needs a checkpoint of it (NaN capture: the
// failing step). A checkpoint made with it (StepAccess::make_checkpoint_at, trainer_view.h) holds these instead of
// the live values: the loop counters, this process's generators (rng/cpu, rng/cuda/<i>, never the
// gathered per-rank states), the model buffers named here (BatchNorm statistics later forwards may
// have moved), the scheduler's position at loop.global_step, no partial accumulation and a clear
// step-guard flag. The weights, the optimizer and the callbacks' state are the live ones (the step's
// update was not applied).
struct StepStart {
  TrainerState loop;
  RngSnapshot rng;
  std::map<std::string, torch::Tensor> buffers;
  // A checkpoint one process makes alone (on_exception_checkpoint under data parallelism): no
  // collective at all, so the logger's epoch sums are this process's own.
  bool local = false;
};

}  // namespace strobe
