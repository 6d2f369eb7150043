#include "runner/init_from.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/json_text.h"
#include "strobe/checkpoint/mapped_file.h"
#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/safetensors.h"
#include "strobe/core/weight_names.h"

namespace strobe {

namespace {

// The `ignore` globs that would leave out what does not fit, as the user would write them: for tensors
// of another shape (a new head) their modules ("fc.*" for a ResNet, "head.*" for a ViT), else the
// missing and unexpected names themselves; three at most.
std::string ignore_hint(const WeightsFit& fit) {
  std::vector<std::string> globs;
  auto add = [&](const std::string& g) {
    if (globs.size() < 3 && std::find(globs.begin(), globs.end(), g) == globs.end()) globs.push_back(g);
  };
  for (const auto& m : fit.misshaped) {
    const std::string name = m.substr(0, m.find(": "));
    const auto dot = name.rfind('.');
    add(dot == std::string::npos ? name : name.substr(0, dot) + ".*");
  }
  for (const auto* names : {&fit.missing, &fit.unexpected})
    for (const auto& n : *names) add(n);
  std::string out;
  for (const auto& g : globs) out += (out.empty() ? "[\"" : ", \"") + g + "\"";
  return out + "]";
}

// A file in another name set than the one given: Hugging Face's checkpoints name the body
// "model.<...>" (LlamaForCausalLM), which `names: strobe` never matches.
std::string names_hint(const std::string& names, const std::string& family, const WeightsFit& fit) {
  if (names == "hf" || fit.unexpected.empty()) return "";
  size_t hf_like = 0;
  for (const auto& n : fit.unexpected) hf_like += n.rfind("model.", 0) == 0;
  if (2 * hf_like < fit.unexpected.size()) return "";
  const bool has_hf = name_map_registry().find(family + ":hf") != nullptr;
  return fmt::format("the file's names start with 'model.', as a Hugging Face checkpoint's do: {}; ",
                     has_hf ? "set model.init_from.names: hf"
                            : fmt::format("model '{}' has no Hugging Face name set (names: hf)", family));
}

// A JSON file beside the weights; one that cannot be read or does not parse is a config error naming
// it under model.init_from.path.
nlohmann::json read_json(const config::Section& init, const std::filesystem::path& path, const char* what) {
  std::optional<checkpoint::MappedFile> file;
  try {
    file.emplace(path.string());  // a FIFO or a device is refused, never waited on
  } catch (const checkpoint::CheckpointError& e) {
    init.fail("path", e.what());
  }
  if (!checkpoint::json_nesting_within({file->data(), file->size()}))
    init.fail("path", fmt::format("{}: {}: nests deeper than {} levels", path.string(), what, checkpoint::kMaxJsonDepth));
  try {
    return nlohmann::json::parse(file->data(), file->data() + file->size());
  } catch (const std::exception& e) {
    init.fail("path", fmt::format("{}: {}: {}", path.string(), what, e.what()));
  }
}

}  // namespace


namespace {

// The family's codec that fills shape keys from a config.json, when init_from names Hugging Face
// weights and the family has one.
const HfConfigCodec* shape_filler(const config::Section& model_cfg, const config::InitFrom& f) {
  if (f.names != "hf") return nullptr;
  const HfConfigCodec* codec = hf_config_registry().find(model_cfg.node()["name"].Scalar());
  return codec != nullptr && codec->fill ? codec : nullptr;
}

}  // namespace

std::vector<std::string> fill_from_hf_config(config::Section& model_cfg, const config::InitFrom& f) {
  namespace fs = std::filesystem;
  const HfConfigCodec* codec = shape_filler(model_cfg, f);
  std::error_code ec;
  if (codec == nullptr || !fs::is_directory(f.path, ec)) return {};
  const fs::path path = fs::path(f.path) / "config.json";
  if (!fs::exists(path, ec)) return {};
  config::Section init = model_cfg.child("init_from");
  return codec->fill(read_json(init, path, "not valid JSON"), model_cfg.node());
}

std::vector<std::string> fill_from_recorded_hf_config(config::Section& model_cfg, const config::InitFrom& f,
                                                      const std::string& text, const std::string& ckpt) {
  const HfConfigCodec* codec = shape_filler(model_cfg, f);
  if (codec == nullptr) return {};
  nlohmann::json source;
  try {
    if (!checkpoint::json_nesting_within(text)) throw config::ConfigError("");
    source = nlohmann::json::parse(text);
  } catch (const std::exception&) {
    throw config::ConfigError(fmt::format("{}: the config.json it recorded (blob hf_config) is not valid JSON", ckpt));
  }
  return codec->fill(source, model_cfg.node());
}

std::optional<std::string> load_init_from(Model& model, config::Section& model_cfg, const config::InitFrom& f, bool speaks) {
  const std::string family = model_cfg.node()["name"].Scalar();
  config::Section init = model_cfg.child("init_from");  // errors name the key and where it was set
  NameMap map;
  try {
    map = make_name_map(family, f.names, model);
  } catch (const WeightNamesError& e) {
    init.fail("names", e.what());
  }
  // The weights: a safetensors file, or a Hugging Face checkpoint directory (model.safetensors, or
  // the shards model.safetensors.index.json lists).
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  std::map<std::string, std::string> indexed;  // a shard index's tensor -> the shard file it names
  fs::path dir;
  std::error_code ec;
  if (fs::is_directory(f.path, ec)) {
    dir = f.path;
    const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
    if (fs::exists(single, ec)) {
      files.push_back(single.string());
    } else if (fs::exists(index, ec)) {
      const nlohmann::json idx = read_json(init, index, "not a valid shard index");
      if (!idx.contains("weight_map") || !idx.at("weight_map").is_object())
        init.fail("path", fmt::format("{}: has no weight_map", index.string()));
      std::set<std::string> shards;
      for (const auto& [name, shard] : idx.at("weight_map").items()) {
        if (!shard.is_string()) init.fail("path", fmt::format("{}: weight_map[\"{}\"] is not a file name", index.string(), name));
        const std::string file = shard.get<std::string>();
        // A shard is a file of this directory: never an absolute path or one that leaves it.
        const fs::path p(file);
        bool leaves = p.is_absolute() || p.empty();
        for (const auto& part : p) leaves |= part == "..";
        if (leaves)
          init.fail("path", fmt::format("{}: weight_map[\"{}\"] names '{}', which is not a file of {}", index.string(), name,
                                        file, dir.string()));
        indexed[name] = (dir / file).string();
        shards.insert(file);
      }
      for (const auto& shard : shards) files.push_back((dir / shard).string());
    } else {
      init.fail("path", fmt::format("{}: a directory without model.safetensors or model.safetensors.index.json", f.path));
    }
  } else {
    files.push_back(f.path);
    dir = fs::path(f.path).parent_path();
  }
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& path : files) {
    safetensors::File file;
    try {
      file = safetensors::read_file(path);
    } catch (const checkpoint::CheckpointError& e) {
      init.fail("path", e.what());  // "PATH: not a safetensors file: ..." / "PATH: cannot open (...)"
    }
    for (auto& [name, t] : file.tensors) {
      // Sharded: each tensor from the shard the index names, and from no other.
      if (!indexed.empty()) {
        const auto named = indexed.find(name);
        if (named == indexed.end())
          init.fail("path", fmt::format("{}: holds '{}', which model.safetensors.index.json does not list", path, name));
        if (named->second != path)
          init.fail("path", fmt::format("'{}' is in {} and the index names {} for it: a tensor in two shards, or an "
                                        "index that does not describe its shards",
                                        name, path, named->second));
      }
      tensors.emplace(name, std::move(t));
    }
  }

  // Hugging Face names: the config.json beside the weights must describe this model.
  std::string checked;
  std::optional<std::string> source_config;
  if (const HfConfigCodec* codec = f.names == "hf" ? hf_config_registry().find(family) : nullptr) {
    const fs::path config = dir / "config.json";
    if (fs::exists(config, ec)) {
      const nlohmann::json source = read_json(init, config, "not valid JSON");
      const HfConfigCheck c = codec->check(source, model_cfg.node());
      if (!c.mismatches.empty()) {
        std::string all;
        for (const auto& m : c.mismatches) all += (all.empty() ? "" : "; ") + m;
        init.fail("path", fmt::format("{} does not describe this model: {}", config.string(), all));
      }
      for (const auto& name : c.ignore)
        if (tensors.count(name)) tensors.erase(name);
      checked = "; config.json agrees";
      source_config = source.dump(2);
    } else {
      checked = "; no config.json beside it: checked by names and shapes only";
    }
  }
  const WeightsFit fit = load_named_weights(model, map, tensors, f.ignore, !f.strict);
  const std::string what = fmt::format("{} ({} names)", f.path, f.names);
  if (!fit.ok() && f.strict)
    model_cfg.fail("init_from", fmt::format("{} does not fit model '{}': {}; {}leave names out with "
                                            "model.init_from.ignore (here: {}) or load what fits "
                                            "with model.init_from.strict: false",
                                            what, family, fit.describe(), names_hint(f.names, family, fit),
                                            ignore_hint(fit)));
  if (!speaks) return source_config;
  if (!fit.ok()) fmt::print(stderr, "strobe: warning: model.init_from: {} does not fit model '{}' (strict: false): {}\n",
                            what, family, fit.describe());
  // What `ignore` left out, the first ten by name (an error lists every name; this is a note).
  std::string ignored;
  for (size_t i = 0; i < fit.ignored.size() && i < 10; ++i) ignored += (i ? ", " : "") + fit.ignored[i];
  if (fit.ignored.size() > 10) ignored += fmt::format(" and {} more", fit.ignored.size() - 10);
  fmt::print("strobe: model.init_from: {} tensors loaded from {}{}{}{}\n", fit.loaded, what,
             fit.ignored.empty() ? "" : fmt::format("; ignored {}: {}", fit.ignored.size(), ignored),
             fit.counts_absent.empty()
                 ? ""
                 : fmt::format("; {} BatchNorm num_batches_tracked absent from the file (the model's kept, as PyTorch "
                               "does)",
                               fit.counts_absent.size()),
             checked);
  std::fflush(stdout);
  return source_config;
}

}  // namespace strobe
