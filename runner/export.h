// strobe export: a checkpoint's model weights as one safetensors file (strobe/checkpoint/
// safetensors.h), under the model's own parameter and buffer names or another ecosystem's (timm,
// torchvision: docs/CONFIG.md, "strobe export").
#pragma once

#include <string>

namespace strobe {

struct ExportOptions {
  std::string checkpoint;  // a Strobe checkpoint (last.ckpt, a top-k file, a capture's checkpoint)
  std::string output;      // the .safetensors file to write (--names hf for a transformers model: a directory)
  bool overwrite = false;  // replace an existing output file
  std::string names = "strobe";  // the name set to write: strobe | timm | torchvision (per model)
  bool ema = false;  // the ema callback's averages (ema/<name>) instead of the weights
  bool swa = false;  // the swa callback's averages (swa/<name>) instead of the weights (not with ema)
};

// Writes every `model/` tensor of the checkpoint (fp32 masters under bf16-master, buffers included)
// with metadata: format "pt", strobe.version, strobe.model (the resolved model config, YAML),
// strobe.step, strobe.epoch and strobe.names (and strobe.ema "true" with `ema`: each tensor the ema
// callback averaged is its `ema/` average; integer buffers stay the model's; a checkpoint without
// averages is an ExportError; `swa` likewise with the swa callback's `swa/` averages and strobe.swa). Another name set than strobe renames the tensors by the
// model family's map (strobe/core/weight_names.h), for which the model is built from the
// checkpoint's saved config. For `--names hf` of a family with a Hugging Face config (llama), the
// output is a directory holding config.json and model.safetensors, which transformers'
// from_pretrained loads. Returns the number of tensors written. Throws
// checkpoint::CheckpointError for a file that is not a Strobe checkpoint or holds no model, and
// ExportError for a name set the model has none of or cannot be mapped to, and for an output that
// exists (without overwrite) or cannot be written.
int export_weights(const ExportOptions& options);

struct ExportError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace strobe
