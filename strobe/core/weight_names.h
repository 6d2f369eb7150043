// Weight names: how a model's parameters and buffers are called in another ecosystem's state dicts
// (timm, torchvision, Hugging Face), so that `model.init_from` reads their files and `strobe export
// --names` writes files they load. One map per model family and name set, registered beside the
// model ("vit:timm"); the name set "strobe" (the model's own names) exists for every model.
//
// A map depends on the model's configuration (ViT: `norm` or `fc_norm` by pooling) and covers every
// tensor of the model. A configuration the other side cannot build exactly (timm's class token with
// average pooling leaves the token out of the mean; Strobe does not) is refused by the map's factory
// with a WeightNamesError saying why: weights are never loaded into a model that computes something
// else than the one they were trained in.
#pragma once

#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>
#include <yaml-cpp/yaml.h>

#include "strobe/config/registry.h"

namespace strobe {

class Model;

struct WeightName {
  std::string strobe;    // the model's name (named_parameters / named_buffers)
  std::string external;  // the same tensor's name in the other state dict
};

struct NameMap {
  std::string names;                // "strobe", "timm", "torchvision", ...
  std::vector<WeightName> entries;  // every parameter and buffer of the model, in the model's order
};

struct WeightNamesError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Builds the map of one model instance; throws WeightNamesError for a configuration it cannot represent.
using NameMapFactory = std::function<NameMap(const Model&)>;
// Keyed "<model family>:<name set>", the family as `model.name` spells it: STROBE_REGISTER(
// name_map_registry(), "vit:timm", make_vit_timm_names).
FactoryTable<NameMapFactory>& name_map_registry();

// Every parameter and buffer of `model` under the name `rename` gives it (a map made of renames).
NameMap renamed(const Model& model, const std::function<std::string(const std::string&)>& rename);

// The name sets `family` can be read and written in: "strobe" first, then the registered ones.
std::vector<std::string> name_sets(const std::string& family);

// The map of `model` (built from `model.name: family`) in name set `names`. Throws WeightNamesError
// for a name set the family has none of ("model 'vit' has no name set 'hf' (it has: strobe, timm,
// torchvision)") and for what the map refuses.
NameMap make_name_map(const std::string& family, const std::string& names, const Model& model);

// What a file's tensors (named as `map` spells them) hold against the model.
struct WeightsFit {
  std::vector<std::string> missing;     // the model has it (in the file's spelling), the file does not
  std::vector<std::string> unexpected;  // the file has it, the model does not
  std::vector<std::string> misshaped;   // "head.weight: [1000, 192] in the file, [10, 192] in the model"
  std::vector<std::string> ignored;     // names `ignore` covered (either side)
  std::vector<std::string> counts_absent;  // BatchNorm num_batches_tracked the file lacks (kept, as PyTorch does)
  int64_t loaded = 0;                   // tensors copied into the model
  bool ok() const { return missing.empty() && unexpected.empty() && misshaped.empty(); }
  // "2 missing from the file: a, b; 1 not in the model: c; 1 of another shape: head.weight: [1000, 192] in the
  // file, [10, 192] in the model": the first 10 names of each kind, then "and N more".
  std::string describe() const;
};

// Copies the file's tensors into the model's parameters and buffers (converted to their dtype, on
// their device) by the map's names. Names matching an `ignore` glob (fnmatch, on the file's
// spelling) are neither loaded nor reported. With `load_partial` false nothing is copied unless
// everything fits; with true every tensor that fits is copied. Returns what was found.
WeightsFit load_named_weights(Model& model, const NameMap& map, const std::map<std::string, torch::Tensor>& file,
                              const std::vector<std::string>& ignore, bool load_partial);

// The model's tensors under the map's names, in the model's order (for writing a file).
std::vector<std::pair<std::string, torch::Tensor>> rename_for_export(
    const NameMap& map, const std::map<std::string, torch::Tensor>& strobe_tensors);

// Hugging Face's config.json for a model family whose "hf" name set is a transformers class: export
// writes it beside the weights, and init_from checks a checkpoint's against the model.
struct HfConfigCheck {
  std::vector<std::string> mismatches;  // "hidden_size: 64 in config.json, model.embed_dim: 32"
  std::vector<std::string> ignore;      // the file's tensors to leave out (a tied head's saved copy)
};
struct HfConfigCodec {
  // config.json of a model built from `model` (the resolved `model:` section).
  std::function<nlohmann::json(const YAML::Node& model)> write;
  // What the model cannot be given a checkpoint with this config.json for.
  std::function<HfConfigCheck(const nlohmann::json& config, const YAML::Node& model)> check;
  // Writes into `model` (the `model:` section, before the model is built) every shape key it leaves
  // unset, from config.json, as from_pretrained takes them (Hugging Face's defaults for what the file
  // lacks); a field of the wrong JSON type is left for `check` to name. Returns the keys written.
  // May be empty: every shape key is then the section's.
  std::function<std::vector<std::string>(const nlohmann::json& config, YAML::Node model)> fill;
};
// Keyed by model family: STROBE_REGISTER(hf_config_registry(), "llama", llama_hf_config).
FactoryTable<HfConfigCodec>& hf_config_registry();

}  // namespace strobe
