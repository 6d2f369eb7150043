#include "framework/core/resume_compat.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include "framework/config/config.h"
#include "framework/config/resume_check.h"

namespace strobe {

std::string check_resume_compatible(const std::string& path, const checkpoint::CheckpointData& data,
                                    const std::string& current_yaml, torch::nn::Module& net) {
  // The first parameter or buffer whose shape differs (or that the checkpoint lacks).
  std::string shape_change;
  auto compare = [&](const std::string& key, const torch::Tensor& t) {
    if (!shape_change.empty()) return;
    auto it = data.tensors.find("model/" + key);
    if (it == data.tensors.end())
      shape_change = fmt::format("'{}' is not in the checkpoint", key);
    else if (it->second.sizes() != t.sizes())
      shape_change = fmt::format("'{}' is {} in the checkpoint, {} now", key, c10::str(it->second.sizes()), c10::str(t.sizes()));
  };
  for (const auto& p : net.named_parameters()) compare(p.key(), p.value());
  for (const auto& b : net.named_buffers()) compare(b.key(), b.value());

  config::ResumeCheck r;
  if (!current_yaml.empty() && data.has_blob("config")) {
    try {
      r = config::compare_for_resume(data.blob("config"), current_yaml);
    } catch (const config::ConfigError& e) {
      throw checkpoint::CheckpointError(fmt::format("{}: {}", path, e.what()));
    }
  }
  std::vector<std::string> refused;
  for (const auto& c : r.incompatible) refused.push_back(fmt::format("{} ({})", c.text(), c.why));
  if (!shape_change.empty()) {
    if (r.model_changes.empty())
      refused.push_back(fmt::format("the model's parameter shapes differ: {}", shape_change));
    else
      refused.push_back(fmt::format("{} changes the model's parameter shapes: {}", config::join_changes(r.model_changes), shape_change));
  } else {
    r.allowed.insert(r.allowed.end(), r.model_changes.begin(), r.model_changes.end());
  }
  if (!refused.empty()) {
    std::string msg = fmt::format("{}: cannot resume with this config: ", path);
    for (size_t i = 0; i < refused.size(); ++i) msg += (i ? "; " : "") + refused[i];
    if (!r.allowed.empty()) msg += fmt::format(" (allowed changes: {})", config::join_changes(r.allowed));
    throw checkpoint::CheckpointError(msg);
  }
  std::sort(r.allowed.begin(), r.allowed.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
  return config::join_changes(r.allowed, 1000);
}

}  // namespace strobe
