// Stop signals (SIGINT, SIGTERM) for the whole process, in two modes.
//
// Outside the training loop (start-up, building the run, loading a checkpoint, validate/test) a
// signal ends the process at once with one line on stderr and exit 128 + signal: there is nothing to
// save yet. Inside the loop (enter_training_loop .. leave_training_loop) the first signal is recorded
// and answered at once with "finishing step N, then saving ..." (the step in progress completes, then
// fit writes last.ckpt and returns 130/143); a second signal ends the process at once, saying that
// nothing was saved for it. A SIGINT the process inherited as ignored (a background job of a
// non-interactive shell, nohup-like launchers) stays ignored for the whole run, as POSIX shells and
// Python keep it; SIGTERM still stops the run.
#pragma once

#include <cstdint>
#include <string>

namespace strobe::signals {

// Called first thing in main (later calls do nothing). Also installs the SIGBUS handler: a memory-
// mapped input truncated under the process ends it with one line naming the file, exit 1.
void install();
bool sigint_inherited_ignored();
// A command that does not train (predict, export, replay, bench, validate, test): a stop signal says
// "strobe NAME: SIGTERM received; stopped ..." instead of speaking of training. Any stop signal
// outside the training loop removes the temporaries being written (checkpoint_io.h).
void set_command(const std::string& name);

// The loop's mode. `save_target` is what the first signal's message promises to write.
void enter_training_loop(const std::string& save_target);
void leave_training_loop();
// The step being computed (global_step + 1), for the first signal's message; cheap (an atomic store).
void set_current_step(int64_t step);
// The first signal received inside the loop, or 0.
int received();
// The step the first signal's message named (-1: none). The loop sets the current step before it
// starts a step and then checks: a signal that named the step before stops the loop right there.
int64_t announced_step();
// Forgets a recorded signal and goes back to the start-up mode (a new fit in the same process).
void reset();

}  // namespace strobe::signals
