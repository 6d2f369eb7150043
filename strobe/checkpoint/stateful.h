// Stateful: an object that writes its own entries into a checkpoint and restores them. The
// StateConnector (strobe/core/state_connector.h) holds one per checkpoint entry, in one order;
// this interface sits on the checkpoint floor so that the objects below the core (the log
// collector) can be Stateful too.
#pragma once

namespace strobe {

namespace checkpoint {
struct CheckpointData;
}
struct StepStart;

// An object that writes its own entries into a checkpoint and restores them.
class Stateful {
 public:
  virtual ~Stateful() = default;
  // `step_start` null: the live state; else the state at that step's start where it differs
  // (loop_state.h: StepStart says which entries do).
  virtual void save(checkpoint::CheckpointData& out, const StepStart* step_start) = 0;
  // Restores from `in` (throws when the data does not fit). Never called when restorable() is false.
  virtual void load(const checkpoint::CheckpointData& in) = 0;
  // False: saved for the record, never restored (the step guard's sticky flag, the run's records).
  virtual bool restorable() const { return true; }
  // True: restored only when resuming training, not when weights are loaded for validate/test.
  virtual bool training_only() const { return true; }
};

}  // namespace strobe
