#include "strobe/config/resume_check.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "strobe/config/config.h"

namespace strobe::config {
namespace {

constexpr const char* kAbsent = "(absent)";

std::string scalar_text(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "null";
  if (n.IsScalar()) return n.Scalar();
  std::string out = "[";  // a list of scalars
  for (size_t i = 0; i < n.size(); ++i) out += (i ? ", " : "") + scalar_text(n[i]);
  return out + "]";
}

// Leaves as (path, text); a list of scalars is one leaf ("[32, 16]"), a list of mappings is indexed.
void flatten(const YAML::Node& n, const std::string& path, std::vector<std::pair<std::string, std::string>>& out) {
  if (n.IsMap()) {
    for (auto it = n.begin(); it != n.end(); ++it)
      flatten(it->second, path.empty() ? it->first.Scalar() : path + "." + it->first.Scalar(), out);
    return;
  }
  if (n.IsSequence()) {
    bool scalars = true;
    for (const auto& e : n) scalars &= !e.IsMap() && !e.IsSequence();
    if (!scalars) {
      for (size_t i = 0; i < n.size(); ++i) flatten(n[i], fmt::format("{}[{}]", path, i), out);
      return;
    }
  }
  out.emplace_back(path, scalar_text(n));
}

ConfigLeaves leaves(const std::string& yaml, const char* what) {
  try {
    return flatten_config(yaml);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}: not a YAML config ({})", what, e.msg));
  }
}

// Keys whose change invalidates saved state, and why.
const char* incompatible_reason(const std::string& key) {
  static const std::map<std::string, const char*> reasons = {
      {"optimizer.name", "the optimizer state (moments, step counts) belongs to the other optimizer"},
      {"scheduler.name", "the scheduler state belongs to the other scheduler"},
      {"trainer.precision", "the saved loss-scaler state and weights were trained under the other precision"},
      {"model.name", "the weights belong to the other model"},
      {"task.name", "the saved state belongs to the other task"},
  };
  auto it = reasons.find(key);
  if (it != reasons.end()) return it->second;
  // Model keys that keep every shape but change the function the weights compute: the rotary
  // embedding (its base and scaling), the norms' epsilon, the GELU form.
  for (const char* k : {"model.rope_theta", "model.rope_scaling", "model.norm_eps", "model.gelu"})
    if (key == k || key.rfind(std::string(k) + ".", 0) == 0)
      return "it changes the function the weights compute (the checkpoint's weights were trained with the other value)";
  // The optimizer's saved state restores its own hyper-parameters (lr, weight decay, betas, ...):
  // a changed value would be listed as a change and silently not applied.
  if (key.rfind("optimizer.", 0) == 0)
    return "a resumed optimizer keeps the checkpoint's hyper-parameters; to train with new ones, start a new run from "
           "these weights";
  return nullptr;
}

}  // namespace

ConfigLeaves flatten_config(const std::string& yaml) {
  if (yaml.empty()) return {};
  return flatten_config(YAML::Load(yaml));
}

ConfigLeaves flatten_config(const YAML::Node& root) {
  ConfigLeaves out;
  flatten(root, "", out);
  return out;
}

namespace {

// The finite or infinite number a YAML scalar's text spells (int or float forms, YAML's .inf), if any.
std::optional<double> number_of(const std::string& s) {
  if (s == ".inf" || s == "+.inf" || s == ".Inf" || s == "+.Inf" || s == ".INF") return HUGE_VAL;
  if (s == "-.inf" || s == "-.Inf" || s == "-.INF") return -HUGE_VAL;
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return std::nullopt;
  // Decimal digits, a sign, a point and an exponent only (no hex, no "nan"/"inf" words).
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '+' && c != 'e' && c != 'E') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return v;
}

std::vector<std::string> list_items(const std::string& s) {
  std::vector<std::string> out;
  if (s.size() < 2 || s.front() != '[' || s.back() != ']') return out;
  const std::string body = s.substr(1, s.size() - 2);
  size_t start = 0;
  while (start <= body.size()) {
    const size_t comma = body.find(", ", start);
    out.push_back(body.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 2;
  }
  return out;
}

}  // namespace

bool same_config_value(const std::string& a, const std::string& b) {
  if (a == b) return true;
  const auto x = number_of(a), y = number_of(b);
  if (x && y) return *x == *y;
  const auto xs = list_items(a), ys = list_items(b);
  if (xs.empty() || xs.size() != ys.size()) return false;
  for (size_t i = 0; i < xs.size(); ++i)
    if (!same_config_value(xs[i], ys[i])) return false;
  return true;
}

std::string ConfigChange::text() const { return fmt::format("{}: {} -> {}", key, before, after); }

std::string join_changes(const std::vector<ConfigChange>& changes, size_t max) {
  std::string out;
  for (size_t i = 0; i < changes.size() && i < max; ++i) out += (i ? ", " : "") + changes[i].text();
  if (changes.size() > max) out += fmt::format(" and {} more", changes.size() - max);
  return out;
}

ResumeCheck compare_for_resume(const std::string& checkpoint_yaml, const std::string& current_yaml) {
  return compare_for_resume(leaves(checkpoint_yaml, "the checkpoint's config"), leaves(current_yaml, "the current config"));
}

ResumeCheck compare_for_resume(const ConfigLeaves& checkpoint, const ConfigLeaves& current) {
  const std::map<std::string, std::string> before(checkpoint.begin(), checkpoint.end()), after(current.begin(), current.end());
  std::vector<ConfigChange> changes;
  for (const auto& [k, v] : before) {
    auto it = after.find(k);
    if (it == after.end())
      changes.push_back({k, v, kAbsent, ""});
    else if (!same_config_value(v, it->second))
      changes.push_back({k, v, it->second, ""});
  }
  for (const auto& [k, v] : after)
    if (!before.count(k)) changes.push_back({k, kAbsent, v, ""});
  // A key that is a leaf on one side and a mapping or list on the other (a section written out in
  // the checkpoint, `null` now): one change from the whole section to the value, not "(absent) -> null"
  // beside the section's leaves going absent.
  auto fold = [&](const std::map<std::string, std::string>& side, bool side_is_before) {
    for (auto& c : changes) {
      if ((side_is_before ? c.before : c.after) != kAbsent) continue;
      std::string text;
      for (auto it = side.lower_bound(c.key); it != side.end() && it->first.rfind(c.key, 0) == 0; ++it) {
        const char next = it->first.size() > c.key.size() ? it->first[c.key.size()] : '\0';
        if (next != '.' && next != '[') continue;
        text += fmt::format("{}{}: {}", text.empty() ? "{" : ", ", it->first.substr(c.key.size() + (next == '.' ? 1 : 0)), it->second);
      }
      if (text.empty()) continue;
      (side_is_before ? c.before : c.after) = text + "}";
      const std::string key = c.key;
      c.key = "\x01" + key;  // marked: the section's own leaves are dropped below
    }
    std::vector<std::string> folded;
    for (const auto& c : changes)
      if (!c.key.empty() && c.key[0] == '\x01') folded.push_back(c.key.substr(1));
    changes.erase(std::remove_if(changes.begin(), changes.end(),
                                 [&](const ConfigChange& c) {
                                   for (const auto& f : folded)
                                     if (c.key.size() > f.size() && c.key.rfind(f, 0) == 0 && (c.key[f.size()] == '.' || c.key[f.size()] == '['))
                                       return true;
                                   return false;
                                 }),
                  changes.end());
    for (auto& c : changes)
      if (!c.key.empty() && c.key[0] == '\x01') c.key = c.key.substr(1);
  };
  fold(before, /*side_is_before=*/true);
  fold(after, /*side_is_before=*/false);
  std::sort(changes.begin(), changes.end(), [](const ConfigChange& a, const ConfigChange& b) { return a.key < b.key; });
  // Another optimizer (scheduler, model, task) brings its own keys: those follow from the name.
  std::vector<std::string> renamed;
  for (const auto& c : changes)
    if (incompatible_reason(c.key) && c.key.size() > 5 && c.key.compare(c.key.size() - 5, 5, ".name") == 0)
      renamed.push_back(c.key.substr(0, c.key.size() - 4));  // "optimizer."
  ResumeCheck r;
  for (auto& c : changes) {
    bool implied = false;
    for (const auto& section : renamed) implied |= c.key.rfind(section, 0) == 0 && c.key != section + "name";
    if (implied) continue;
    if (const char* why = incompatible_reason(c.key)) {
      c.why = why;
      r.incompatible.push_back(c);
    } else if (c.key.rfind("model.init_from", 0) == 0) {
      r.allowed.push_back(c);  // the weights a run started from: a resume loads the checkpoint's own
    } else if (c.key.rfind("model.", 0) == 0) {
      r.model_changes.push_back(c);
    } else {
      r.allowed.push_back(c);
    }
  }
  return r;
}

}  // namespace strobe::config
