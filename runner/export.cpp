#include "runner/export.h"

#include <sys/stat.h>

#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "framework/checkpoint/checkpoint_io.h"
#include "framework/checkpoint/safetensors.h"
#include "framework/config/experiment.h"
#include "runner/plugins.h"
#include "framework/core/model.h"
#include "framework/core/weight_names.h"

namespace strobe {

namespace {

// The checkpoint's tensors under another name set: the model is built from the checkpoint's saved
// config (its map depends on the configuration) and its map renames them.
safetensors::NamedTensors rename_tensors(const ExportOptions& options, const checkpoint::CheckpointData& data,
                                         const safetensors::NamedTensors& tensors, std::optional<nlohmann::json>& hf_config) {
  const std::string flag = "--names " + options.names;
  if (!data.has_blob("config"))
    throw ExportError(fmt::format("{}: {} has no saved config to build its model from", flag, options.checkpoint));
  std::shared_ptr<Model> model;
  std::string family;
  try {
    auto doc = config::Document::load_string(data.blob("config"), options.checkpoint + " (saved config)");
    // A plugin's model is built by its plugin (which may register its name sets too): load the
    // plugins the checkpoint recorded, at their recorded hashes (PluginError, exit 2, otherwise).
    load_plugins(config::recorded_plugins(data.blob("config"), options.checkpoint));
    config::Section section = doc.root().child("model");
    family = section.require_string("name");
    config::parse_init_from(section);  // accepts the key: the weights come from the checkpoint
    model = model_registry().create(section, "");
    // A transformers class: its config.json goes beside the weights.
    if (options.names == "hf")
      if (const HfConfigCodec* codec = hf_config_registry().find(family)) hf_config = codec->write(section.node());
  } catch (const config::ConfigError& e) {
    throw ExportError(fmt::format("{}: the checkpoint's saved model config does not build: {}", flag, e.what()));
  }
  try {
    const NameMap map = make_name_map(family, options.names, *model);
    return rename_for_export(map, std::map<std::string, torch::Tensor>(tensors.begin(), tensors.end()));
  } catch (const WeightNamesError& e) {
    throw ExportError(fmt::format("{}: {}", flag, e.what()));
  }
}

}  // namespace

int export_weights(const ExportOptions& options) {
  checkpoint::CheckpointData data = checkpoint::load_checkpoint_file(options.checkpoint);
  safetensors::NamedTensors tensors;
  const std::string prefix = "model/";
  for (const auto& [key, tensor] : data.tensors)
    if (key.rfind(prefix, 0) == 0) tensors.emplace_back(key.substr(prefix.size()), tensor);
  if (tensors.empty())
    throw checkpoint::CheckpointError(fmt::format("{}: holds no model weights (no 'model/' tensors)", options.checkpoint));

  std::optional<nlohmann::json> hf_config;
  if (options.names != "strobe") tensors = rename_tensors(options, data, tensors, hf_config);

  std::map<std::string, std::string> metadata{
      {"format", "pt"}, {"strobe.version", STROBE_VERSION}, {"strobe.names", options.names}};
  if (data.has_blob("config")) {
    YAML::Node model = YAML::Load(data.blob("config"))["model"];
    if (model.IsDefined()) {
      YAML::Emitter out;
      out << model;
      metadata["strobe.model"] = out.c_str();
    }
  }
  if (data.has_blob("meta")) {
    auto meta = nlohmann::json::parse(data.blob("meta"), nullptr, false);
    if (meta.is_object()) {
      if (meta.contains("global_step")) metadata["strobe.step"] = meta["global_step"].dump();
      if (meta.contains("epoch")) metadata["strobe.epoch"] = meta["epoch"].dump();
    }
  }

  struct stat st {};
  if (hf_config) {
    // A Hugging Face checkpoint directory: config.json + model.safetensors.
    namespace fs = std::filesystem;
    std::error_code ec;
    if (::stat(options.output.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode))
        throw ExportError(fmt::format("-o {}: exists and is not a directory (--names hf writes a directory: config.json + "
                                      "model.safetensors)", options.output));
      if (!fs::is_empty(options.output, ec) && !options.overwrite)
        throw ExportError(fmt::format("-o {}: the directory holds files (pass --overwrite to replace its config.json and "
                                      "model.safetensors)", options.output));
    } else if (!fs::create_directories(options.output, ec)) {
      throw ExportError(fmt::format("-o {}: cannot create the directory ({})", options.output, ec.message()));
    }
    try {
      safetensors::write_file((fs::path(options.output) / "model.safetensors").string(), tensors, metadata);
      checkpoint::write_file_atomic((fs::path(options.output) / "config.json").string(), hf_config->dump(2) + "\n");
    } catch (const checkpoint::CheckpointError& e) {
      throw ExportError(fmt::format("-o {}: cannot write it: {}", options.output, e.what()));
    }
    return static_cast<int>(tensors.size());
  }
  if (::stat(options.output.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) throw ExportError(fmt::format("-o {}: is a directory", options.output));
    if (!options.overwrite)
      throw ExportError(fmt::format("-o {}: the file exists (pass --overwrite to replace it)", options.output));
  }
  try {
    safetensors::write_file(options.output, tensors, metadata);
  } catch (const checkpoint::CheckpointError& e) {
    throw ExportError(fmt::format("-o {}: cannot write it: {}", options.output, e.what()));
  }
  return static_cast<int>(tensors.size());
}

}  // namespace strobe
