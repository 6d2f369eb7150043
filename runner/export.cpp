#include "runner/export.h"

#include <sys/stat.h>

#include <map>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "framework/checkpoint/checkpoint_io.h"
#include "framework/checkpoint/safetensors.h"

namespace strobe {

int export_weights(const ExportOptions& options) {
  checkpoint::CheckpointData data = checkpoint::load_checkpoint_file(options.checkpoint);
  safetensors::NamedTensors tensors;
  const std::string prefix = "model/";
  for (const auto& [key, tensor] : data.tensors)
    if (key.rfind(prefix, 0) == 0) tensors.emplace_back(key.substr(prefix.size()), tensor);
  if (tensors.empty())
    throw checkpoint::CheckpointError(fmt::format("{}: holds no model weights (no 'model/' tensors)", options.checkpoint));

  std::map<std::string, std::string> metadata{{"format", "pt"}, {"strobe.version", STROBE_VERSION}};
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
