// strobe export: a checkpoint's model weights as one safetensors file (framework/checkpoint/
// safetensors.h), under the model's own parameter and buffer names (docs/CONFIG.md, "strobe export").
#pragma once

#include <string>

namespace strobe {

struct ExportOptions {
  std::string checkpoint;  // a Strobe checkpoint (last.ckpt, a top-k file, a capture's checkpoint)
  std::string output;      // the .safetensors file to write
  bool overwrite = false;  // replace an existing output file
};

// Writes every `model/` tensor of the checkpoint (fp32 masters under bf16-master, buffers included)
// with metadata: format "pt", strobe.version, strobe.model (the resolved model config, YAML),
// strobe.step and strobe.epoch. Returns the number of tensors written. Throws
// checkpoint::CheckpointError for a file that is not a Strobe checkpoint or holds no model, and
// ExportError for an output that exists (without overwrite) or cannot be written.
int export_weights(const ExportOptions& options);

struct ExportError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace strobe
