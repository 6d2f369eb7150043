// StateConnector: the one place where everything a checkpoint must hold is registered
// (docs/ARCHITECTURE.md, "The state connector"). Save, resume, NaN capture and replay all go through it, so they serialise
// the same state. What is registered is an object that saves and loads its own state (Stateful):
// the fit loop's progress and accumulation window, the step pipeline's guard, the log collector,
// the RNG, the optimizer, the scheduler, the loss scaler, the callbacks, the model and the run's
// records. NaN capture asks for a step's start through the same objects (save with a StepStart):
// one place knows the checkpoint's layout, and the keys of a capture are those of any checkpoint.
//
// Contract: the connector is built with the entries' names in their one order (kOrder); an object is
// registered under its name when it exists (the optimizer, scheduler, scaler and step pipeline at
// fit's setup), and entries are saved and loaded in that order whenever they were registered.
// load() restores every restorable entry; training-only ones (optimizer, accumulation, RNG, ...)
// only when resuming training, not for validate/test. A load throws checkpoint::CheckpointError (naming the entry) when the data does
// not fit.
#pragma once

#include <string>
#include <vector>

#include "strobe/checkpoint/stateful.h"

namespace strobe {

class StateConnector {
 public:
  // The entries, in save and load order (docs/ARCHITECTURE.md's table).
  static const std::vector<std::string>& kOrder();

  // `name` must be one of kOrder and not registered yet; `object` outlives the connector's use.
  void add(const std::string& name, Stateful& object);
  void save(checkpoint::CheckpointData& out, const StepStart* step_start = nullptr) const;
  // `source` names the file in error messages.
  void load(const checkpoint::CheckpointData& in, bool training_state, const std::string& source) const;
  // The registered entries' names, in order.
  std::vector<std::string> names() const;

 private:
  struct Entry {
    std::string name;
    Stateful* object;
  };
  std::vector<Entry> entries_;  // kept in kOrder's order
};

}  // namespace strobe
