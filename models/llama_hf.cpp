// Llama and Hugging Face's LlamaForCausalLM: the weight names (`--names hf`, model.init_from with
// names: hf) and the config.json codec (written by `strobe export --names hf`, checked and filled
// from a transformers directory by model.init_from).
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "models/llama.h"
#include "strobe/core/weight_names.h"

namespace strobe::models {
namespace {

// Hugging Face's names: ours under "model.", the head as it is.
NameMap llama_hf_names(const Model& model) {
  return renamed(model, [](const std::string& n) { return n == "lm_head.weight" ? n : "model." + n; });
}

// config.json of LlamaForCausalLM, in the form Hugging Face's Llama checkpoints carry (rope_theta and
// rope_scaling at the top level).
nlohmann::json llama_hf_config_json(const YAML::Node& m) {
  const int64_t dim = m["embed_dim"].as<int64_t>(), heads = m["num_heads"].as<int64_t>();
  nlohmann::json c = {{"architectures", {"LlamaForCausalLM"}},
                      {"model_type", "llama"},
                      {"vocab_size", m["vocab_size"].as<int64_t>()},
                      {"hidden_size", dim},
                      {"intermediate_size", m["ffn_dim"].as<int64_t>()},
                      {"num_hidden_layers", m["depth"].as<int64_t>()},
                      {"num_attention_heads", heads},
                      {"num_key_value_heads", m["num_kv_heads"].as<int64_t>()},
                      {"head_dim", dim / heads},
                      {"hidden_act", "silu"},
                      {"max_position_embeddings", m["max_seq_len"].as<int64_t>()},
                      {"rms_norm_eps", m["norm_eps"].as<double>()},
                      {"rope_theta", m["rope_theta"].as<double>()},
                      {"rope_scaling", nullptr},
                      {"tie_word_embeddings", m["tie_embeddings"].as<bool>()},
                      {"attention_bias", false},
                      {"attention_dropout", 0.0},
                      {"mlp_bias", false},
                      {"initializer_range", m["init_std"].as<double>()},
                      {"torch_dtype", "float32"}};
  const YAML::Node rs = m["rope_scaling"];
  if (rs && rs.IsMap())
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", rs["factor"].as<double>()},
                         {"low_freq_factor", rs["low_freq_factor"].as<double>()},
                         {"high_freq_factor", rs["high_freq_factor"].as<double>()},
                         {"original_max_position_embeddings", rs["original_max_position_embeddings"].as<int64_t>()}};
  return c;
}

// The rotary settings of a config.json in either spelling: rope_parameters (transformers 5) or
// rope_scaling (the hub's checkpoints), with rope_theta at the top level or among them.
struct HfRope {
  nlohmann::json params;  // an object, empty when neither is
  nlohmann::json theta;
};
HfRope hf_rope(const nlohmann::json& c) {
  HfRope r;
  r.params = c.contains("rope_parameters") && c["rope_parameters"].is_object() ? c["rope_parameters"]
             : c.contains("rope_scaling") && c["rope_scaling"].is_object()     ? c["rope_scaling"]
                                                                              : nlohmann::json::object();
  r.theta = c.contains("rope_theta") ? c["rope_theta"] : r.params.value("rope_theta", nlohmann::json(10000.0));
  return r;
}

// What a LlamaForCausalLM config.json must agree on with the model. Both spellings of the rotary
// settings are read: rope_theta + rope_scaling (the hub's checkpoints) and rope_parameters
// (transformers 5). max_position_embeddings only bounds max_seq_len: a shorter context is normal.
HfConfigCheck llama_hf_config_check(const nlohmann::json& c, const YAML::Node& m) {
  HfConfigCheck out;
  // A value of the wrong JSON type is a mismatch naming its key, never an exception; null is unset.
  auto json_type = [](const nlohmann::json& v) -> std::string {
    return v.is_object() ? "an object" : v.is_array() ? "an array" : v.is_string() ? "a string"
           : v.is_boolean() ? "a boolean" : v.is_number() ? "a number" : "null";
  };
  if (!c.is_object()) {
    out.mismatches.push_back(fmt::format("it is {}, not a JSON object", json_type(c)));
    return out;
  }
  auto typed = [&](const nlohmann::json& obj, const std::string& where, const char* key, bool (nlohmann::json::*is)() const noexcept,
                   const char* expected) {
    if (!obj.contains(key) || obj[key].is_null()) return false;
    if ((obj[key].*is)()) return true;
    out.mismatches.push_back(fmt::format("{}{}: {} in config.json is {}, expected {}", where, key, obj[key].dump(),
                                         json_type(obj[key]), expected));
    return false;
  };
  auto text = [&](const nlohmann::json& obj, const std::string& where, const char* key, const std::string& fallback) {
    return typed(obj, where, key, &nlohmann::json::is_string, "a string") ? obj[key].get<std::string>() : fallback;
  };
  // A boolean field: its value, false when unset, nullopt when of the wrong type (already reported).
  auto flag = [&](const char* key) -> std::optional<bool> {
    if (!c.contains(key) || c[key].is_null()) return false;
    if (!typed(c, "", key, &nlohmann::json::is_boolean, "true or false")) return std::nullopt;
    return c[key].get<bool>();
  };
  for (const char* k : {"rope_scaling", "rope_parameters"}) typed(c, "", k, &nlohmann::json::is_object, "an object");
  auto differs = [&](const std::string& hf, const nlohmann::json& theirs, const std::string& ours, const std::string& mine) {
    out.mismatches.push_back(fmt::format("{}: {} in config.json, model.{}: {}", hf, theirs.dump(), ours, mine));
  };
  auto integer = [&](const char* hf, const char* ours, std::optional<int64_t> fallback = std::nullopt) {
    const int64_t mine = m[ours].as<int64_t>();
    if (!c.contains(hf) || c[hf].is_null()) {
      if (fallback && *fallback != mine) differs(hf, *fallback, ours, std::to_string(mine));
      if (!fallback) out.mismatches.push_back(fmt::format("{}: missing from config.json (model.{}: {})", hf, ours, mine));
      return;
    }
    if (!c[hf].is_number_integer() || c[hf].get<int64_t>() != mine) differs(hf, c[hf], ours, std::to_string(mine));
  };
  auto real = [&](const char* hf, const nlohmann::json& theirs, const char* ours, double mine) {
    if (!theirs.is_number() || std::abs(theirs.get<double>() - mine) > 1e-9 * std::max(1.0, std::abs(mine)))
      differs(hf, theirs, ours, fmt::format("{}", mine));
  };
  const std::string type = text(c, "", "model_type", "llama");
  if (type != "llama") out.mismatches.push_back(fmt::format("model_type: \"{}\" in config.json, not \"llama\"", type));
  integer("vocab_size", "vocab_size");
  integer("hidden_size", "embed_dim");
  integer("intermediate_size", "ffn_dim");
  integer("num_hidden_layers", "depth");
  integer("num_attention_heads", "num_heads");
  const int64_t heads = m["num_heads"].as<int64_t>(), dim = m["embed_dim"].as<int64_t>();
  integer("num_key_value_heads", "num_kv_heads",
          c.contains("num_attention_heads") && c["num_attention_heads"].is_number_integer() ? c["num_attention_heads"].get<int64_t>()
                                                                                             : heads);
  if (c.contains("head_dim") && !c["head_dim"].is_null() && c["head_dim"] != dim / heads)
    out.mismatches.push_back(fmt::format("head_dim: {} in config.json, but this model's is model.embed_dim / model.num_heads = {} "
                                         "(a separate head_dim is not implemented)",
                                         c["head_dim"].dump(), dim / heads));
  real("rms_norm_eps", c.value("rms_norm_eps", nlohmann::json(1e-6)), "norm_eps", m["norm_eps"].as<double>());
  const auto [params, theta] = hf_rope(c);
  real("rope_theta", theta, "rope_theta", m["rope_theta"].as<double>());
  const std::string rope_type = text(params, "rope_scaling.", "rope_type", text(params, "rope_scaling.", "type", "default"));
  const YAML::Node rs = m["rope_scaling"];
  const bool scaled = rs && rs.IsMap();
  if (rope_type != "default" && rope_type != "llama3") {
    out.mismatches.push_back(fmt::format("rope_scaling.rope_type: \"{}\" in config.json (this model implements llama3 only)", rope_type));
  } else if ((rope_type == "llama3") != scaled) {
    differs("rope_scaling.rope_type", rope_type, "rope_scaling", scaled ? "llama3" : "null");
  } else if (scaled) {
    for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
      real((std::string("rope_scaling.") + k).c_str(), params.value(k, nlohmann::json(nullptr)),
           (std::string("rope_scaling.") + k).c_str(), rs[k].as<double>());
  }
  const std::optional<bool> tie = flag("tie_word_embeddings");
  const bool tied = tie.value_or(false);
  if (tie && tied != m["tie_embeddings"].as<bool>())
    differs("tie_word_embeddings", tied, "tie_embeddings", m["tie_embeddings"].as<bool>() ? "true" : "false");
  if (tied) out.ignore.push_back("lm_head.weight");  // a tied checkpoint may carry the head's copy
  for (const char* k : {"attention_bias", "mlp_bias"})
    if (flag(k).value_or(false)) out.mismatches.push_back(fmt::format("{}: true in config.json (this model has no biases)", k));
  const std::string act = text(c, "", "hidden_act", "silu");
  if (act != "silu") out.mismatches.push_back(fmt::format("hidden_act: \"{}\" in config.json (this model's MLP is SwiGLU: silu)", act));
  if (c.contains("max_position_embeddings") && c["max_position_embeddings"].is_number_integer() &&
      m["max_seq_len"].as<int64_t>() > c["max_position_embeddings"].get<int64_t>())
    out.mismatches.push_back(fmt::format("max_position_embeddings: {} in config.json, below model.max_seq_len: {}",
                                         c["max_position_embeddings"].get<int64_t>(), m["max_seq_len"].as<int64_t>()));
  return out;
}

// The shape of a LlamaForCausalLM config.json into the model keys the section leaves unset, with
// transformers' LlamaConfig defaults for the fields the file lacks (rms_norm_eps 1e-6, rope_theta
// 10000, num_key_value_heads = num_attention_heads, untied).
std::vector<std::string> llama_hf_config_fill(const nlohmann::json& c, YAML::Node m) {
  std::vector<std::string> filled;
  if (!c.is_object()) return filled;  // the check names it
  auto unset = [&](const char* ours) { return !m[ours] || m[ours].IsNull(); };
  auto put = [&](const char* ours, const auto& value) {
    m[ours] = value;
    filled.push_back(ours);
  };
  auto integer = [&](const char* hf, const char* ours) {
    if (unset(ours) && c.contains(hf) && c[hf].is_number_integer()) put(ours, c[hf].get<int64_t>());
  };
  integer("vocab_size", "vocab_size");
  integer("hidden_size", "embed_dim");
  integer("intermediate_size", "ffn_dim");
  integer("num_hidden_layers", "depth");
  integer("num_attention_heads", "num_heads");
  integer(c.contains("num_key_value_heads") ? "num_key_value_heads" : "num_attention_heads", "num_kv_heads");
  integer("max_position_embeddings", "max_seq_len");
  const nlohmann::json eps = c.value("rms_norm_eps", nlohmann::json(1e-6));
  if (unset("norm_eps") && eps.is_number()) put("norm_eps", eps.get<double>());
  const auto [params, theta] = hf_rope(c);
  if (unset("rope_theta") && theta.is_number()) put("rope_theta", theta.get<double>());
  const nlohmann::json type = params.contains("rope_type") ? params["rope_type"] : params.value("type", nlohmann::json("default"));
  if (unset("rope_scaling") && type == "llama3") {
    bool numbers = true;
    for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
      numbers &= params.contains(k) && params[k].is_number();
    if (numbers) {
      YAML::Node rs;
      rs["rope_type"] = "llama3";
      for (const char* k : {"factor", "low_freq_factor", "high_freq_factor"}) rs[k] = params[k].get<double>();
      rs["original_max_position_embeddings"] = params["original_max_position_embeddings"].get<int64_t>();
      put("rope_scaling", rs);
    }
  }
  const nlohmann::json tie = c.value("tie_word_embeddings", nlohmann::json(false));
  if (unset("tie_embeddings") && tie.is_boolean()) put("tie_embeddings", tie.get<bool>());
  return filled;
}

}  // namespace

STROBE_REGISTER(name_map_registry(), "llama:hf", llama_hf_names);
STROBE_REGISTER(hf_config_registry(), "llama", (HfConfigCodec{llama_hf_config_json, llama_hf_config_check, llama_hf_config_fill}));

}  // namespace strobe::models
