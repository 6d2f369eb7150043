#include "strobe/core/resume_compat.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include <algorithm>
#include <map>
#include <vector>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/config/resume_check.h"
#include "strobe/core/checkpoint_view.h"

namespace strobe {

namespace {

// Keys that shape the model (model.init_from only names the weights a run started from).
bool is_model_key(const std::string& k) {
  if (k.rfind("model.init_from", 0) == 0) return false;
  return k == "model" || k.rfind("model.", 0) == 0 || k.rfind("model[", 0) == 0;
}

// "'a' (and 3 more)"
std::string first_of(const std::vector<std::string>& names) {
  std::string s = fmt::format("'{}'", names.front());
  if (names.size() > 1) s += fmt::format(" (and {} more)", names.size() - 1);
  return s;
}

}  // namespace

ConfigComparison compare_configs(const checkpoint::CheckpointData& data, const std::string& current_yaml,
                                 const std::shared_ptr<const config::SavedConfig>& parsed) {
  ConfigComparison c;
  const std::string* text = CheckpointView(data, data.source).config();
  if (text == nullptr) return c;
  try {
    c.saved = parsed && parsed->text() == *text ? parsed
                                                : std::make_shared<const config::SavedConfig>(*text, "the checkpoint's config");
    if (!current_yaml.empty()) c.check = config::compare_for_resume(c.saved->leaves(), config::flatten_config(current_yaml));
  } catch (const config::ConfigError& e) {
    c.error = e.what();
  } catch (const YAML::Exception& e) {
    c.error = fmt::format("the current config: not a YAML config ({})", e.msg);
  }
  return c;
}

std::string weights_mismatch(const checkpoint::CheckpointData& data, const ConfigComparison& configs, torch::nn::Module& net) {
  std::map<std::string, torch::Tensor> own;
  for (const auto& p : net.named_parameters()) own.emplace(p.key(), p.value());
  for (const auto& b : net.named_buffers()) own.emplace(b.key(), b.value());
  const CheckpointView view(data, "");
  std::vector<std::string> missing, unexpected, misshaped;
  std::string first_shape;
  for (const auto& [name, t] : own) {
    const torch::Tensor* saved = view.model_tensor(name);
    if (saved == nullptr) {
      missing.push_back(name);
    } else if (saved->sizes() != t.sizes()) {
      if (misshaped.empty())
        first_shape = fmt::format("'{}' is {} in the checkpoint, {} in the model", name, c10::str(saved->sizes()), c10::str(t.sizes()));
      misshaped.push_back(name);
    }
  }
  for (const auto& [name, t] : view.model_tensors())
    if (!own.count(name)) unexpected.push_back(name);
  if (missing.empty() && unexpected.empty() && misshaped.empty()) return "";

  std::vector<std::string> parts;
  if (!missing.empty()) parts.push_back("missing " + first_of(missing));
  if (!unexpected.empty()) parts.push_back("unexpected " + first_of(unexpected));
  if (!misshaped.empty())
    parts.push_back(misshaped.size() > 1 ? fmt::format("{} (and {} more mis-shaped)", first_shape, misshaped.size() - 1) : first_shape);
  std::string tensors;
  for (size_t i = 0; i < parts.size(); ++i) tensors += (i ? "; " : "") + parts[i];

  // The model keys of the checkpoint's own config that differ from the current config, when both are known.
  // A saved config that does not parse: the tensor names alone say what differs.
  std::vector<std::string> keys;
  if (const auto& r = configs.check)
    for (const auto* list : {&r->incompatible, &r->model_changes, &r->allowed})
      for (const auto& c : *list)
        if (is_model_key(c.key)) keys.push_back(fmt::format("{}: checkpoint {}, config {}", c.key, c.before, c.after));
  std::sort(keys.begin(), keys.end());
  if (keys.empty()) return tensors;
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", " : "") + keys[i];
  return fmt::format("{} ({})", out, tensors);
}

std::string function_changes(const ConfigComparison& configs) {
  if (!configs.check) return "";
  std::vector<std::string> keys;
  for (const auto& c : configs.check->incompatible)
    if (is_model_key(c.key)) keys.push_back(fmt::format("{}: checkpoint {}, config {}", c.key, c.before, c.after));
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", " : "") + keys[i];
  return out.empty() ? out : out + " (they change the function the weights compute)";
}

std::string run_config_hint(const std::string& ckpt_path, const ConfigComparison& configs) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path ck(ckpt_path);
  if (configs.saved == nullptr || ck.parent_path().filename() != "checkpoints") return "";
  const fs::path run_config = ck.parent_path().parent_path() / "config.yaml";
  if (!fs::is_regular_file(run_config, ec) || fs::file_size(run_config, ec) > (1u << 20)) return "";
  std::ifstream in(run_config);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    const auto r = config::compare_for_resume(configs.saved->leaves(), config::flatten_config(text));
    for (const auto* list : {&r.incompatible, &r.model_changes, &r.allowed})
      for (const auto& c : *list)
        if (is_model_key(c.key) && c.key.rfind("model.init_from", 0) != 0) return "";
  } catch (const YAML::Exception&) {
    return "";
  }
  return fmt::format("; -c {} builds the model this checkpoint was trained as", run_config.string());
}

std::vector<config::ConfigChange> check_resume_compatible(const std::string& path, const checkpoint::CheckpointData& data,
                                                          const ConfigComparison& configs, torch::nn::Module& net) {
  if (!configs.error.empty()) throw checkpoint::CheckpointError(fmt::format("{}: {}", path, configs.error));
  const std::string mismatch = weights_mismatch(data, configs, net);
  config::ResumeCheck r = configs.check.value_or(config::ResumeCheck{});
  std::vector<std::string> refused;
  for (const auto& c : r.incompatible) refused.push_back(fmt::format("{} ({})", c.text(), c.why));
  if (!mismatch.empty()) {
    refused.push_back(fmt::format("the checkpoint's weights do not fit this model: {}", mismatch));
  } else {
    r.allowed.insert(r.allowed.end(), r.model_changes.begin(), r.model_changes.end());
  }
  if (!refused.empty()) {
    std::string msg = fmt::format("{}: cannot resume with this config: ", path);
    for (size_t i = 0; i < refused.size(); ++i) msg += (i ? "; " : "") + refused[i];
    if (!r.allowed.empty()) msg += fmt::format(" (allowed changes: {})", config::join_changes(r.allowed));
    if (!mismatch.empty()) msg += run_config_hint(path, configs);
    throw checkpoint::CheckpointError(msg);
  }
  std::sort(r.allowed.begin(), r.allowed.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
  return r.allowed;
}

}  // namespace strobe
