// The profiler callback (trainer.profiler, `strobe fit --profile`): a Chrome / TensorBoard trace of
// training steps first..last (1-based optimizer steps, the numbering of metrics.csv) through
// libtorch's Kineto profiler, CPU ops and, on CUDA, kernels and copies. Each step is one
// `ProfilerStep#N` range from the start of step N to the start of step N+1 (the last one to the end
// of its optimizer step), as PyTorch's torch.profiler.profile().step() marks them, so TensorBoard's
// profiler plugin (torch-tb-profiler) and chrome://tracing / Perfetto read it. The file is
// <dir>/<host>_<pid>.<unix ms>.pt.trace.json (tensorboard_trace_handler's name), written atomically
// once step `last` ends (or, with a note on stderr, when training ends earlier).
#pragma once

#include <memory>
#include <string>

#include "strobe/config/experiment.h"
#include "strobe/core/callback.h"

namespace strobe {

// `dir`: where the trace goes (created when fit starts; an unusable one is a ConfigError).
std::shared_ptr<Callback> make_profiler_callback(const config::ProfilerConfig& cfg, const std::string& dir);

}  // namespace strobe
