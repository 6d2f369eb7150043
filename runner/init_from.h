// model.init_from (docs/MODELS.md "Pretrained weights"): a safetensors file's tensors, by the name set
// it is spelled in (strobe/core/weight_names.h), into a freshly built model.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "strobe/config/experiment.h"
#include "strobe/core/model.h"

namespace strobe {

// Loads `f` into `model`, built from `model_cfg` (its `name` is the family the name set belongs to).
// Call it before the optimizer, the device move, channels_last or bf16-master see the parameters.
// Throws config::ConfigError naming the key: an unknown name set or one the model's configuration
// cannot be mapped to (model.init_from.names), a file that cannot be read or is not safetensors
// (model.init_from.path), and, with strict, every name and shape that does not fit, in one message.
// With `speaks`, prints what was loaded (stdout) and, without strict, what did not fit (stderr).
// Returns the text of the Hugging Face config.json the weights came with (names: hf, a config.json
// that agrees with the model), which checkpoints keep (blob `hf_config`) for `export --names hf`.
std::optional<std::string> load_init_from(Model& model, config::Section& model_cfg, const config::InitFrom& f, bool speaks);

// Before the model is built: with names: hf and a config.json beside the weights, the shape keys
// `model_cfg` leaves unset are taken from it (the family's HfConfigCodec::fill, as from_pretrained
// does), so the model is built to fit the checkpoint and the resolved config records them; the keys
// that are set are checked by load_init_from. Returns the keys taken. Throws config::ConfigError
// naming model.init_from.path for a config.json that cannot be read or parsed.
std::vector<std::string> fill_from_hf_config(config::Section& model_cfg, const config::InitFrom& f);

// The same from a checkpoint (`fit`/`validate`/`test`/`predict --ckpt`): the config.json its weights
// came with (blob `hf_config`, `text`), so a config that leaves the shape to config.json builds the
// model the checkpoint holds even when model.init_from.path is gone. `ckpt` names the checkpoint in
// errors.
std::vector<std::string> fill_from_recorded_hf_config(config::Section& model_cfg, const config::InitFrom& f,
                                                      const std::string& text, const std::string& ckpt);

}  // namespace strobe
