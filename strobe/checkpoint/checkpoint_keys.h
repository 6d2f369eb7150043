// The names of a training checkpoint's entries: the one place they are spelled. Each entry's
// writer and reader use these (the state connector registers the run's state under them;
// strobe/core/checkpoint_view.h reads the run's record; ShardedCheckpoint adds zero2's own).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace strobe::checkpoint_keys {

// The run's record (blobs).
inline constexpr const char* kMeta = "meta";            // what wrote it and where the run stood (JSON)
inline constexpr const char* kConfig = "config";        // the resolved experiment YAML
inline constexpr const char* kHfConfig = "hf_config";   // the config.json model.init_from came with
inline constexpr const char* kCallbacks = "callbacks";  // each callback's state_dict by its state key (JSON)
// The training state, one entry per state connector registration (strobe/core/state_connector.h).
inline constexpr const char* kModel = "model";            // tensors under kModelPrefix
inline constexpr const char* kModelPrefix = "model/";     // tensors model/<parameter or buffer>
inline constexpr const char* kOptimizer = "optimizer";    // the optimizer's archive (zero2: this rank's shard)
inline constexpr const char* kScheduler = "scheduler";    // the learning-rate schedule (JSON)
inline constexpr const char* kScaler = "scaler";          // 16-mixed's loss scale
inline constexpr const char* kLoop = "loop";              // the loop counters (strobe/core/loop_state.h)
inline constexpr const char* kDataExclude = "data_exclude";  // the saved epoch's excluded samples (JSON)
// The config (YAML) the saved epoch's order came from, when that is not the checkpoint's own config:
// an epoch finishing with an earlier data config after a resume (docs/DATA.md, "Mixes").
inline constexpr const char* kDataEpochConfig = "data_epoch_config";
// Validation by time (trainer.val_check_interval as a duration): the training seconds since the last
// validation and the count of those validations (JSON {"since_s", "count"}).
inline constexpr const char* kValClock = "val_clock";
inline constexpr const char* kAccumulation = "accumulation";  // the accumulation window's micro-batches (JSON)
inline constexpr const char* kAccumulationGradPrefix = "accumulation/grad/";  // inside a window: partial gradients
inline constexpr const char* kLogger = "logger";          // the log accumulators' counts (JSON)
inline constexpr const char* kMlflow = "mlflow";          // logger.mlflow's run: {"run_id", "experiment_id", "tracking_uri"}
inline constexpr const char* kStepGuard = "step_guard";   // the step pipeline's guard and spike window
inline constexpr const char* kRng = "rng";                // the generators: tensors rng/cpu, rng/cuda/<index>

inline std::string rng_cpu() { return "rng/cpu"; }
inline std::string rng_cuda_prefix() { return "rng/cuda/"; }
inline std::string rng_cuda(int64_t index) { return rng_cuda_prefix() + std::to_string(index); }
// Data parallel: every rank's generators, gathered by rank 0 ("cpu" or "cuda").
inline std::string rng_of_rank(int64_t rank, const std::string& which) { return "rng/rank" + std::to_string(rank) + "/" + which; }

// A NaN capture's own entries, beside a full checkpoint's (strobe/core/capture.h).
inline constexpr const char* kCapture = "capture";                 // the capture record (JSON)
inline constexpr const char* kCaptureBatches = "capture_batches";  // each micro-batch's meta (JSON list)
inline constexpr const char* kCaptureIndices = "capture_indices";  // each micro-batch's dataset indices (JSON list)
inline constexpr const char* kCaptureBatchPrefix = "capture/batch/";  // tensors capture/batch/<i>/<key>
inline std::string capture_batch(size_t i, const std::string& key) {
  return kCaptureBatchPrefix + std::to_string(i) + "/" + key;
}

}  // namespace strobe::checkpoint_keys
