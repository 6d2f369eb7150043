// StateConnector: the one place where everything a checkpoint must hold is registered
// (docs/ARCHITECTURE.md, "The state connector"). Save, resume, NaN capture and replay all go through it, so they serialise
// the same state; a new piece of state (a loop counter, a flag, a callback) is one add() call. NaN
// capture asks for a step's start through the same entries (save with a StepStart): one place knows
// the checkpoint's layout, and the keys of a capture are those of any checkpoint.
//
// Contract: entries are saved in registration order into one CheckpointData. load() restores every
// entry in registration order; entries registered as training state (optimizer, loop counters,
// RNG, ...) are restored only when resuming training, not for validate/test. A load function
// throws checkpoint::CheckpointError (naming the entry) when the data does not fit.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace strobe {

namespace checkpoint {
struct CheckpointData;
}
struct StepStart;

class StateConnector {
 public:
  // `step_start` null: the live state; else the entry records that step's start where it differs
  // (loop_state.h: StepStart says which entries do).
  using SaveFn = std::function<void(checkpoint::CheckpointData&, const StepStart* step_start)>;
  using LoadFn = std::function<void(const checkpoint::CheckpointData&)>;
  enum class Kind { Always, TrainingOnly };

  void add(std::string name, SaveFn save, LoadFn load, Kind kind = Kind::TrainingOnly);
  void save(checkpoint::CheckpointData& out, const StepStart* step_start = nullptr) const;
  // `source` names the file in error messages.
  void load(const checkpoint::CheckpointData& in, bool training_state, const std::string& source) const;
  std::vector<std::string> names() const;

 private:
  struct Entry {
    std::string name;
    SaveFn save;
    LoadFn load;
    Kind kind;
  };
  std::vector<Entry> entries_;
};

}  // namespace strobe
