#include "strobe/core/checkpoint_view.h"

#include <fmt/format.h>

namespace strobe {

const std::string* CheckpointView::blob(const char* key) const {
  auto it = data_.blobs.find(key);
  return it == data_.blobs.end() ? nullptr : &it->second;
}

void CheckpointEditor::set_config(std::string yaml) { data_.blobs[checkpoint_keys::kConfig] = std::move(yaml); }

void CheckpointEditor::drop_logger_sums() { data_.blobs.erase(checkpoint_keys::kLogger); }

void CheckpointEditor::set_world_size(int64_t world_size) {
  auto it = data_.blobs.find(checkpoint_keys::kMeta);
  if (it == data_.blobs.end()) return;
  auto meta = nlohmann::json::parse(it->second, nullptr, false);
  if (!meta.is_object()) return;
  meta["world_size"] = world_size;
  it->second = meta.dump();
}

void CheckpointEditor::move_cuda_generator(int64_t from, int64_t to) {
  auto it = data_.tensors.find(checkpoint_keys::rng_cuda(from));
  if (it != data_.tensors.end()) data_.tensors[checkpoint_keys::rng_cuda(to)] = it->second;
}

CheckpointMeta CheckpointView::meta() const {
  CheckpointMeta m;
  const std::string* b = blob(checkpoint_keys::kMeta);
  if (b == nullptr) return m;
  const auto j = nlohmann::json::parse(*b, nullptr, false);
  if (!j.is_object()) return m;
  auto integer = [&](const char* k) -> std::optional<int64_t> {
    auto it = j.find(k);
    return it != j.end() && it->is_number_integer() ? std::optional<int64_t>(it->get<int64_t>()) : std::nullopt;
  };
  auto text = [&](const char* k) {
    auto it = j.find(k);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  m.format_version = integer("format_version").value_or(0);
  m.strobe_version = text("strobe_version");
  m.device = text("device");
  m.precision = text("precision");
  m.global_step = integer("global_step");
  m.epoch = integer("epoch");
  m.world_size = integer("world_size").value_or(1);
  m.rank_alone = integer("rank_alone");
  return m;
}

const std::string* CheckpointView::config() const { return blob(checkpoint_keys::kConfig); }

const std::string& CheckpointView::require_config() const {
  const std::string* c = config();
  if (c == nullptr)
    throw checkpoint::CheckpointError(fmt::format("{}: holds no saved config (blob '{}')", source_, checkpoint_keys::kConfig));
  return *c;
}

const std::string* CheckpointView::hf_config() const { return blob(checkpoint_keys::kHfConfig); }

std::map<std::string, torch::Tensor> CheckpointView::model_tensors() const {
  const std::string prefix = checkpoint_keys::kModelPrefix;
  std::map<std::string, torch::Tensor> out;
  for (auto it = data_.tensors.lower_bound(prefix); it != data_.tensors.end() && it->first.rfind(prefix, 0) == 0; ++it)
    out.emplace(it->first.substr(prefix.size()), it->second);
  return out;
}

std::map<std::string, torch::Tensor> CheckpointView::weight_averages(const std::string& prefix,
                                                                     const std::map<std::string, torch::Tensor>& weights) const {
  std::map<std::string, torch::Tensor> out;
  for (auto it = data_.tensors.lower_bound(prefix); it != data_.tensors.end() && it->first.rfind(prefix, 0) == 0; ++it) {
    const std::string name = it->first.substr(prefix.size());
    const auto w = weights.find(name);
    if (w == weights.end() || !w->second.is_floating_point())
      throw checkpoint::CheckpointError(
          fmt::format("{}: {}: an average of no floating weight of this model", source_, it->first));
    if (!it->second.is_floating_point())
      throw checkpoint::CheckpointError(fmt::format("{}: {}: an average of {} elements (expected floating point)", source_,
                                                    it->first, c10::toString(it->second.scalar_type())));
    if (it->second.sizes() != w->second.sizes())
      throw checkpoint::CheckpointError(fmt::format("{}: {}: shape {}, but the weight's is {}", source_, it->first,
                                                    c10::str(it->second.sizes()), c10::str(w->second.sizes())));
    out.emplace(name, it->second);
  }
  if (out.empty()) return out;
  for (const auto& [name, t] : weights)
    if (t.is_floating_point() && !out.count(name))
      throw checkpoint::CheckpointError(fmt::format("{}: holds {} averages but not {}{}", source_, prefix, prefix, name));
  return out;
}

const torch::Tensor* CheckpointView::model_tensor(const std::string& name) const {
  auto it = data_.tensors.find(checkpoint_keys::kModelPrefix + name);
  return it == data_.tensors.end() ? nullptr : &it->second;
}

nlohmann::json CheckpointView::callback_states() const {
  const std::string* b = blob(checkpoint_keys::kCallbacks);
  if (b == nullptr) return nlohmann::json::object();
  auto j = nlohmann::json::parse(*b, nullptr, false);
  if (!j.is_object())
    throw checkpoint::CheckpointError(
        fmt::format("{}: its callback states (blob '{}') are not a JSON object", source_, checkpoint_keys::kCallbacks));
  return j;
}

}  // namespace strobe
