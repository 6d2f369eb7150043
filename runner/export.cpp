#include "runner/export.h"

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/output_guard.h"
#include "strobe/checkpoint/safetensors.h"
#include "strobe/config/experiment.h"
#include "strobe/config/saved_config.h"
#include "runner/plugins.h"
#include "strobe/core/checkpoint_view.h"
#include "strobe/core/model.h"
#include "strobe/core/weight_names.h"

namespace strobe {

namespace {

// The checkpoint's tensors under another name set: the model is built from the checkpoint's saved
// config (its map depends on the configuration) and its map renames them.
safetensors::NamedTensors rename_tensors(const ExportOptions& options, const config::SavedConfig* saved,
                                         const safetensors::NamedTensors& tensors, std::optional<nlohmann::json>& hf_config) {
  const std::string flag = "--names " + options.names;
  if (saved == nullptr)
    throw ExportError(fmt::format("{}: {} has no saved config to build its model from", flag, options.checkpoint));
  std::shared_ptr<Model> model;
  std::string family;
  try {
    auto doc = saved->document();
    // A plugin's model is built by its plugin (which may register its name sets too): load the
    // plugins the checkpoint recorded, at their recorded hashes (PluginError, exit 2, otherwise).
    load_plugins(saved->plugins());
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

// The run's config.json when its weights came from a Hugging Face directory (blob `hf_config`): its
// fields are kept (max_position_embeddings, bos/eos/pad token ids, anything transformers or a
// tokenizer reads), and the model's own fields written over them, but for max_position_embeddings:
// the source's context length, which bounds the run's max_seq_len, stays.
nlohmann::json with_source_fields(const nlohmann::json& ours, const CheckpointView& view) {
  if (view.hf_config() == nullptr) return ours;
  nlohmann::json merged = nlohmann::json::parse(*view.hf_config(), nullptr, false);
  if (!merged.is_object()) return ours;
  for (const auto& [key, value] : ours.items())
    if (key != "max_position_embeddings" || !merged.contains(key)) merged[key] = value;
  // transformers 5 spells torch_dtype "dtype": the weights' dtype is ours, under either name.
  if (merged.contains("dtype") && ours.contains("torch_dtype")) merged["dtype"] = ours["torch_dtype"];
  return merged;
}

// generation_config.json, as transformers derives it from a model config (GenerationConfig.
// from_model_config): the token ids that generate() needs; none when config.json names none.
std::optional<nlohmann::json> generation_config_of(const nlohmann::json& config) {
  nlohmann::json g = {{"_from_model_config", true}};
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (config.contains(key) && !config[key].is_null()) g[key] = config[key];
  if (g.size() == 1) return std::nullopt;
  return g;
}

namespace fs = std::filesystem;

}  // namespace

int export_weights(const ExportOptions& options) {
  // The output, checked before the checkpoint is read (docs/CONFIG.md, "Outputs"): never the
  // checkpoint being exported nor, for a directory, one holding it or another run's files.
  const bool hf_dir = options.names == "hf";
  const std::vector<checkpoint::CommandInput> inputs{{"the checkpoint being exported", options.checkpoint}};
  if (hf_dir)
    checkpoint::check_output_directory("-o", options.output, options.overwrite, inputs);
  else
    checkpoint::check_output_file({"-o", options.output, options.overwrite, inputs});
  const checkpoint::CheckpointData data = checkpoint::load_checkpoint_file(options.checkpoint);
  const CheckpointView view(data, options.checkpoint);
  safetensors::NamedTensors tensors;
  for (const auto& [name, tensor] : view.model_tensors()) tensors.emplace_back(name, tensor);
  if (tensors.empty())
    throw checkpoint::CheckpointError(fmt::format("{}: holds no model weights (no 'model/' tensors)", options.checkpoint));
  if (options.ema && options.swa) throw ExportError("--ema and --swa: choose one of the two averages");
  if (options.ema || options.swa) {
    const std::string kind = options.ema ? "ema" : "swa";
    const auto averages = view.weight_averages(kind + "/", view.model_tensors());  // checked whole, each problem named
    for (auto& [name, tensor] : tensors)
      if (auto it = averages.find(name); it != averages.end()) tensor = it->second;
    if (averages.empty())
      throw ExportError(fmt::format("--{}: {} holds no weight average (no '{}/' tensors: train with the {} callback)", kind,
                                    options.checkpoint, kind, kind));
  }

  // The saved config, parsed once: the model it builds (other name sets) and the model section
  // the file's metadata records.
  std::optional<config::SavedConfig> saved;
  if (const std::string* text = view.config()) {
    try {
      saved.emplace(*text, options.checkpoint + " (saved config)");
    } catch (const config::ConfigError& e) {
      throw checkpoint::CheckpointError(e.what());
    }
  }
  std::optional<nlohmann::json> hf_config;
  if (options.names != "strobe") tensors = rename_tensors(options, saved ? &*saved : nullptr, tensors, hf_config);
  std::optional<nlohmann::json> generation_config;
  if (hf_config) {
    hf_config = with_source_fields(*hf_config, view);
    generation_config = generation_config_of(*hf_config);
  }

  std::map<std::string, std::string> metadata{
      {"format", "pt"}, {"strobe.version", STROBE_VERSION}, {"strobe.names", options.names}};
  if (options.ema) metadata["strobe.ema"] = "true";
  if (options.swa) metadata["strobe.swa"] = "true";
  if (saved)
    if (std::string model = saved->section_yaml("model"); !model.empty()) metadata["strobe.model"] = std::move(model);
  const CheckpointMeta meta = view.meta();
  if (meta.global_step) metadata["strobe.step"] = std::to_string(*meta.global_step);
  if (meta.epoch) metadata["strobe.epoch"] = std::to_string(*meta.epoch);

  if (hf_config && fs::path(options.output).extension() == ".safetensors")
    throw ExportError(fmt::format("-o {}: --names hf writes a directory (config.json + model.safetensors), not a "
                                  ".safetensors file: give a directory name",
                                  options.output));
  if (hf_config) {
    // A Hugging Face checkpoint directory: config.json + model.safetensors.
    std::error_code ec;
    checkpoint::write_output("-o", options.output, [&] {
      // Both files are written as temporaries and both targets checked before either is renamed: a
      // failed export leaves an existing directory as it was (other files in it, a tokenizer, stay).
      const std::string config_text = hf_config->dump(2) + "\n";
      std::vector<std::unique_ptr<checkpoint::PendingWrite>> files;
      files.push_back(safetensors::prepare_file((fs::path(options.output) / "model.safetensors").string(), tensors, metadata));
      files.push_back(std::make_unique<checkpoint::PendingWrite>(
          (fs::path(options.output) / "config.json").string(),
          std::vector<checkpoint::ByteSpan>{{config_text.data(), config_text.size()}}));
      const std::string generation_text = generation_config ? generation_config->dump(2) + "\n" : "";
      if (generation_config)
        files.push_back(std::make_unique<checkpoint::PendingWrite>(
            (fs::path(options.output) / "generation_config.json").string(),
            std::vector<checkpoint::ByteSpan>{{generation_text.data(), generation_text.size()}}));
      for (const auto& file : files)
        if (fs::is_directory(file->path(), ec))
          throw ExportError(fmt::format("-o {}: {} is a directory; nothing was replaced", options.output, file->path()));
      for (auto& file : files) file->commit();
    });
    return static_cast<int>(tensors.size());
  }
  checkpoint::write_output("-o", options.output, [&] { safetensors::write_file(options.output, tensors, metadata); });
  return static_cast<int>(tensors.size());
}

}  // namespace strobe
