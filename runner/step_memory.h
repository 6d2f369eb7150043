// The memory a training step needs, measured before a fit claims its run directory (README,
// "Quickstart"; docs/CONFIG.md, "Errors, exit codes"): a forward and backward of the task's
// training_step on the first 2 and then 4 samples of the training data, on the run's device: on the
// CPU through an allocator that counts every byte libtorch allocates there, on CUDA by the caching
// allocator's peak (the model moved to the device first, where the trainer puts it next). The
// difference is what one more sample costs (activations kept for backward, gradients of
// activations); the rest is what the step costs at any size (parameter gradients, workspaces). The
// model's state is restored afterwards (buffers such as BatchNorm's statistics, the parameters'
// gradients, the global generator), so the run trains as if nothing had run. A batch of
// data.batch_size whose step, plus the optimizer's state (and on CUDA the parameters and buffers),
// would not fit the host memory available or the device's free memory is a config error naming
// data.batch_size, before any run file. trainer.memory_check: false skips the trial.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <torch/types.h>

#include "strobe/config/experiment.h"

namespace strobe {

class DataModule;
class Module;

struct StepMemory {
  double per_sample = 0;  // bytes one more sample adds to the step's peak
  double fixed = 0;       // bytes the step's peak holds at any batch size
  double optimizer = 0;   // bytes of the optimizer's state (two moments per trainable parameter)
  double resident = 0;    // bytes of parameters and buffers still to be allocated where the step runs (CUDA)
  int64_t batch = 0;      // the micro-batch it was estimated for
  double available = 0;   // bytes the step may use: host memory available, or the device's free bytes
  std::string where;      // what `available` is, for the message

  double total() const { return resident + fixed + per_sample * static_cast<double>(batch) + optimizer; }
};

// nullopt where it is not measured: trainer.memory_check false, a device other than the CPU or CUDA,
// several processes, bf16-master
// (the trial would run in fp32), fewer than 4 training samples, or a trial step that throws (the run
// then meets the error itself).
std::optional<StepMemory> measure_step_memory(const config::Experiment& exp, DataModule& dm, Module& module,
                                              const torch::Device& device, int64_t world_size);

// Throws a config error at data.batch_size when `m.total()` exceeds `m.available`.
void check_step_memory(config::Section& data_cfg, const StepMemory& m);

}  // namespace strobe
