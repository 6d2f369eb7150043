// What a run needs in host memory, checked before it is allocated (docs/CONFIG.md, "Errors"): one
// estimator for the whole setup. The experiment builder checks a training batch times the batches
// the loader holds (runner/experiment_builder.cpp); a model's factory checks its parameters before
// it builds them, so a shape too large for this machine (a config.json's hidden_size of a million)
// is one line and exit 2, not an allocation that fails or the kernel's OOM killer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strobe/config/config.h"

namespace strobe {

// Bytes of memory this process can still allocate: MemAvailable, bounded by the cgroup's limit.
uint64_t available_memory_bytes();

// "1.5 GiB".
std::string human_bytes(double bytes);

// One term of a model's parameter count and the key that sets it ({"embed_dim", one layer's attention}).
struct ParamTerm {
  const char* key;
  double params;
};

// Refuses (ConfigError) a model whose `params` parameters would not fit in the memory available as
// they are built (fp32, 4 bytes each), naming the first key of `alone` whose term alone would not
// fit, else `otherwise` (the key that multiplies the terms: depth); `shape` describes the values
// behind the estimate ("embed_dim 1000000, depth 16, ...").
void check_parameters_fit(const config::Section& cfg, double params, const std::vector<ParamTerm>& alone, const char* otherwise,
                          const std::string& shape);

}  // namespace strobe
