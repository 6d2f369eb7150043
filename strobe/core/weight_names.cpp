#include "strobe/core/weight_names.h"

#include <fnmatch.h>

#include <set>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/model.h"

namespace strobe {

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out;
}

bool ignored(const std::string& name, const std::vector<std::string>& globs) {
  for (const auto& g : globs)
    if (::fnmatch(g.c_str(), name.c_str(), 0) == 0) return true;
  return false;
}

}  // namespace

NameMap renamed(const Model& model, const std::function<std::string(const std::string&)>& rename) {
  NameMap map;
  for (const auto& p : model.named_parameters()) map.entries.push_back({p.key(), rename(p.key())});
  for (const auto& b : model.named_buffers()) map.entries.push_back({b.key(), rename(b.key())});
  return map;
}

FactoryTable<NameMapFactory>& name_map_registry() {
  static FactoryTable<NameMapFactory> r("weight name map");
  return r;
}

FactoryTable<HfConfigCodec>& hf_config_registry() {
  static FactoryTable<HfConfigCodec> r("Hugging Face config");
  return r;
}

std::vector<std::string> name_sets(const std::string& family) {
  std::vector<std::string> out{"strobe"};
  const std::string prefix = family + ":";
  for (const auto& key : name_map_registry().names())
    if (key.rfind(prefix, 0) == 0) out.push_back(key.substr(prefix.size()));
  return out;
}

NameMap make_name_map(const std::string& family, const std::string& names, const Model& model) {
  NameMap map;
  if (names == "strobe") {
    map = renamed(model, [](const std::string& n) { return n; });
  } else {
    const NameMapFactory* factory = name_map_registry().find(family + ":" + names);
    if (factory == nullptr) {
      const auto known = name_sets(family);
      const std::string hint = config::closest_match(names, known);
      throw WeightNamesError(fmt::format("model '{}' has no name set '{}'{} (it has: {})", family, names,
                                         hint.empty() ? "" : fmt::format("; did you mean '{}'?", hint), join(known)));
    }
    map = (*factory)(model);
    map.names = names;
  }
  // A map names every tensor of the model once, and no external name twice.
  std::set<std::string> model_names, strobe_seen, external_seen;
  for (const auto& p : model.named_parameters()) model_names.insert(p.key());
  for (const auto& b : model.named_buffers()) model_names.insert(b.key());
  for (const auto& e : map.entries) {
    TORCH_CHECK(model_names.count(e.strobe), "weight name map ", family, ":", names, " names '", e.strobe,
                "', which the model does not have");
    TORCH_CHECK(strobe_seen.insert(e.strobe).second, "weight name map ", family, ":", names, " maps '", e.strobe, "' twice");
    TORCH_CHECK(external_seen.insert(e.external).second, "weight name map ", family, ":", names, " uses '", e.external,
                "' twice");
  }
  TORCH_CHECK(strobe_seen.size() == model_names.size(), "weight name map ", family, ":", names, " covers ",
              strobe_seen.size(), " of the model's ", model_names.size(), " tensors");
  return map;
}

std::string WeightsFit::describe() const {
  // The first names of each kind and the count: a file of 100,000 stray tensors is one readable line.
  constexpr size_t kShown = 10;
  auto first = [&](const std::vector<std::string>& v) {
    std::vector<std::string> head(v.begin(), v.begin() + std::min(v.size(), kShown));
    return join(head) + (v.size() > kShown ? fmt::format(" and {} more", v.size() - kShown) : "");
  };
  std::vector<std::string> parts;
  if (!missing.empty()) parts.push_back(fmt::format("{} missing from the file: {}", missing.size(), first(missing)));
  if (!unexpected.empty())
    parts.push_back(fmt::format("{} not in the model: {}", unexpected.size(), first(unexpected)));
  if (!misshaped.empty()) parts.push_back(fmt::format("{} of another shape: {}", misshaped.size(), first(misshaped)));
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? "; " : "") + parts[i];
  return out;
}

WeightsFit load_named_weights(Model& model, const NameMap& map, const std::map<std::string, torch::Tensor>& file,
                              const std::vector<std::string>& ignore, bool load_partial) {
  std::map<std::string, torch::Tensor> targets;
  for (const auto& p : model.named_parameters()) targets[p.key()] = p.value();
  for (const auto& b : model.named_buffers()) targets[b.key()] = b.value();

  WeightsFit fit;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;  // (model tensor, file tensor)
  std::set<std::string> claimed;
  for (const auto& e : map.entries) {
    claimed.insert(e.external);
    if (ignored(e.external, ignore)) {
      fit.ignored.push_back(e.external);
      continue;
    }
    auto it = file.find(e.external);
    if (it == file.end()) {
      // BatchNorm's step count, absent from files saved before PyTorch 0.4.1 and from converted or
      // cleaned ones: PyTorch's strict load_state_dict fills it, and so does this (the model's own).
      const std::string count = "num_batches_tracked";
      const bool is_count = e.external.size() >= count.size() &&
                            e.external.compare(e.external.size() - count.size(), count.size(), count) == 0 &&
                            (e.external.size() == count.size() || e.external[e.external.size() - count.size() - 1] == '.');
      if (is_count)
        fit.counts_absent.push_back(e.external);
      else
        fit.missing.push_back(e.external);
      continue;
    }
    const torch::Tensor& target = targets.at(e.strobe);
    if (it->second.sizes() != target.sizes()) {
      fit.misshaped.push_back(fmt::format("{}: {} in the file, {} in the model", e.external, c10::str(it->second.sizes()),
                                          c10::str(target.sizes())));
      continue;
    }
    copies.emplace_back(target, it->second);
  }
  for (const auto& [name, tensor] : file) {
    if (claimed.count(name)) continue;
    if (ignored(name, ignore))
      fit.ignored.push_back(name);
    else
      fit.unexpected.push_back(name);
  }
  if (!fit.ok() && !load_partial) return fit;
  torch::NoGradGuard no_grad;
  for (auto& [target, source] : copies) target.copy_(source);
  fit.loaded = static_cast<int64_t>(copies.size());
  return fit;
}

std::vector<std::pair<std::string, torch::Tensor>> rename_for_export(
    const NameMap& map, const std::map<std::string, torch::Tensor>& strobe_tensors) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::vector<std::string> missing;
  for (const auto& e : map.entries) {
    auto it = strobe_tensors.find(e.strobe);
    if (it == strobe_tensors.end())
      missing.push_back(e.strobe);
    else
      out.emplace_back(e.external, it->second);
  }
  if (!missing.empty() || out.size() != strobe_tensors.size())
    throw WeightNamesError(fmt::format("the weights do not fit the model their config builds{}",
                                       missing.empty() ? "" : fmt::format(" (missing: {})", join(missing))));
  return out;
}

}  // namespace strobe
