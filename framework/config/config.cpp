#include "framework/config/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>

#include <fmt/format.h>

namespace strobe::config {
namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out;
}

bool is_null_node(const YAML::Node& n) { return !n.IsDefined() || n.IsNull(); }

const std::regex& int_re() {
  static const std::regex re(R"(^[-+]?(0|[1-9][0-9]*)$)");
  return re;
}
const std::regex& float_re() {
  static const std::regex re(R"(^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$)");
  return re;
}

}  // namespace

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  if (best.empty() && word.size() >= 2) {
    // A known name that starts with the word (bf16 -> bf16-mixed) is the likely intent.
    for (const auto& c : candidates)
      if (c.rfind(word, 0) == 0) return c;
  }
  return best;
}

int64_t CountOrFraction::resolve(int64_t total) const {
  if (is_count) return std::min(count, total);
  if (fraction <= 0.0) return 0;
  return std::max<int64_t>(1, static_cast<int64_t>(std::floor(fraction * static_cast<double>(total))));
}

Section::Section(YAML::Node node, std::string path, std::shared_ptr<SourceInfo> source)
    : node_(node), path_(std::move(path)), source_(std::move(source)) {}

std::string Section::key_path(const std::string& key) const {
  if (key.empty()) return path_;
  return path_.empty() ? key : path_ + "." + key;
}

std::string Section::location(const std::string& key) const {
  std::string kp = key_path(key);
  // An override of this key or of any enclosing key explains the value.
  for (std::string p = kp;;) {
    auto it = source_->overrides.find(p);
    if (it != source_->overrides.end()) return it->second;
    auto dot = p.rfind('.');
    if (dot == std::string::npos) break;
    p = p.substr(0, dot);
  }
  YAML::Mark mark = YAML::Mark::null_mark();
  if (!key.empty() && node_.IsMap()) {
    for (auto it = node_.begin(); it != node_.end(); ++it) {
      if (it->first.Scalar() == key) {
        mark = it->first.Mark();
        break;
      }
    }
  }
  if (mark.is_null() && node_.IsDefined()) mark = node_.Mark();
  if (mark.is_null() || mark.line < 0) return source_->file;
  return fmt::format("{}:{}:{}", source_->file, mark.line + 1, mark.column + 1);
}

void Section::fail(const std::string& key, const std::string& what) const {
  throw ConfigError(fmt::format("{}: {}: {}", location(key), key_path(key), what));
}

void Section::fail_here(const std::string& what) const {
  throw ConfigError(fmt::format("{}: {}: {}", location(""), path_.empty() ? "(top level)" : path_, what));
}

bool Section::has(const std::string& key) const {
  return node_.IsMap() && node_[key].IsDefined();
}

bool Section::is_null(const std::string& key) const {
  return !has(key) || node_[key].IsNull();
}

YAML::Node Section::scalar(const std::string& key, const char* expected) {
  known_.insert(key);
  YAML::Node v = node_[key];
  if (!v.IsScalar()) fail(key, fmt::format("expected {}, got a {}", expected, v.IsMap() ? "mapping" : "sequence"));
  return v;
}

bool Section::get_bool(const std::string& key, bool def) {
  known_.insert(key);
  if (is_null(key)) {
    node_[key] = def;
    return def;
  }
  YAML::Node v = scalar(key, "true or false");
  const std::string& s = v.Scalar();
  if (s == "true" || s == "True" || s == "yes") return true;
  if (s == "false" || s == "False" || s == "no") return false;
  fail(key, fmt::format("expected true or false, got '{}'", s));
}

int64_t Section::get_int(const std::string& key, int64_t def, int64_t min, int64_t max) {
  known_.insert(key);
  if (is_null(key)) {
    node_[key] = def;
    return def;
  }
  YAML::Node v = scalar(key, "an integer");
  const std::string& s = v.Scalar();
  auto range = [&] {
    if (min != INT64_MIN && max != INT64_MAX) return fmt::format(" in [{}, {}]", min, max);
    if (min != INT64_MIN) return fmt::format(" >= {}", min);
    if (max != INT64_MAX) return fmt::format(" <= {}", max);
    return std::string();
  };
  if (!std::regex_match(s, int_re())) fail(key, fmt::format("expected an integer{}, got '{}'", range(), s));
  errno = 0;
  long long x = std::strtoll(s.c_str(), nullptr, 10);
  if (errno == ERANGE || x < min || x > max) fail(key, fmt::format("expected an integer{}, got {}", range(), s));
  return x;
}

double Section::get_double(const std::string& key, double def, double min, double max) {
  known_.insert(key);
  if (is_null(key)) {
    node_[key] = def;
    return def;
  }
  YAML::Node v = scalar(key, "a number");
  const std::string& s = v.Scalar();
  if (!std::regex_match(s, float_re())) fail(key, fmt::format("expected a number, got '{}'", s));
  double x = std::strtod(s.c_str(), nullptr);
  if (!std::isfinite(x) || x < min || x > max) {
    std::string range = max < 1e308 ? fmt::format("in [{}, {}]", min, max) : fmt::format(">= {}", min);
    fail(key, fmt::format("expected a number {}, got {}", range, s));
  }
  return x;
}

std::string Section::get_string(const std::string& key, const std::string& def) {
  known_.insert(key);
  if (is_null(key)) {
    node_[key] = def;
    return def;
  }
  return scalar(key, "a string").Scalar();
}

std::optional<std::string> Section::get_optional_string(const std::string& key) {
  known_.insert(key);
  if (is_null(key)) {
    node_[key] = YAML::Node(YAML::NodeType::Null);
    return std::nullopt;
  }
  return scalar(key, "a string").Scalar();
}

std::string Section::require_string(const std::string& key) {
  known_.insert(key);
  if (is_null(key)) fail_here(fmt::format("missing required key '{}'", key));
  return scalar(key, "a string").Scalar();
}

std::string Section::get_choice(const std::string& key, const std::string& def,
                                const std::vector<std::string>& choices) {
  std::string v = get_string(key, def);
  if (std::find(choices.begin(), choices.end(), v) != choices.end()) return v;
  std::string hint = closest_match(v, choices);
  fail(key, fmt::format("expected one of {}, got '{}'{}", join(choices), v,
                        hint.empty() ? "" : fmt::format(" (did you mean '{}'?)", hint)));
}

std::vector<int64_t> Section::get_int_list(const std::string& key, const std::vector<int64_t>& def) {
  known_.insert(key);
  if (is_null(key)) {
    YAML::Node seq(YAML::NodeType::Sequence);
    for (auto x : def) seq.push_back(x);
    node_[key] = seq;
    return def;
  }
  YAML::Node v = node_[key];
  if (!v.IsSequence()) fail(key, "expected a list of integers");
  std::vector<int64_t> out;
  for (const auto& e : v) {
    if (!e.IsScalar() || !std::regex_match(e.Scalar(), int_re()))
      fail(key, fmt::format("expected a list of integers, got element '{}'", e.IsScalar() ? e.Scalar() : "?"));
    out.push_back(std::strtoll(e.Scalar().c_str(), nullptr, 10));
  }
  return out;
}

CountOrFraction Section::get_count_or_fraction(const std::string& key, CountOrFraction def) {
  known_.insert(key);
  if (is_null(key)) {
    if (def.is_count)
      node_[key] = def.count;
    else
      node_[key] = def.fraction;
    return def;
  }
  const std::string& s = scalar(key, "an integer count or a fraction").Scalar();
  CountOrFraction r;
  if (std::regex_match(s, int_re())) {
    r.is_count = true;
    r.count = std::strtoll(s.c_str(), nullptr, 10);
    if (r.count < 0) fail(key, fmt::format("expected a count >= 0 or a fraction in [0, 1], got {}", s));
    return r;
  }
  if (std::regex_match(s, float_re())) {
    r.fraction = std::strtod(s.c_str(), nullptr);
    if (r.fraction < 0.0 || r.fraction > 1.0)
      fail(key, fmt::format("expected a count >= 0 or a fraction in [0, 1], got {}", s));
    return r;
  }
  fail(key, fmt::format("expected an integer count or a fraction in [0, 1], got '{}'", s));
}

Section Section::child(const std::string& key) {
  known_.insert(key);
  if (is_null(key)) node_[key] = YAML::Node(YAML::NodeType::Map);
  YAML::Node v = node_[key];
  if (!v.IsMap()) fail(key, "expected a mapping of keys");
  return Section(v, key_path(key), source_);
}

std::vector<Section> Section::list(const std::string& key) {
  known_.insert(key);
  std::vector<Section> out;
  if (is_null(key)) {
    node_[key] = YAML::Node(YAML::NodeType::Sequence);
    return out;
  }
  YAML::Node v = node_[key];
  if (!v.IsSequence()) fail(key, "expected a list");
  for (size_t i = 0; i < v.size(); ++i) {
    YAML::Node e = v[i];
    Section s(e, fmt::format("{}[{}]", key_path(key), i), source_);
    if (!e.IsMap()) s.fail_here("expected a mapping with a 'name'");
    out.push_back(s);
  }
  return out;
}

void Section::finish() const {
  if (!node_.IsMap()) return;
  std::vector<std::string> known(known_.begin(), known_.end());
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    const std::string key = it->first.Scalar();
    if (known_.count(key)) continue;
    std::string hint = closest_match(key, known);
    fail(key, hint.empty() ? fmt::format("unknown key (known keys: {})", join(known))
                           : fmt::format("unknown key; did you mean '{}'?", hint));
  }
}

Document Document::load_string(const std::string& text, const std::string& source_name) {
  Document d;
  d.source_ = std::make_shared<SourceInfo>();
  d.source_->file = source_name;
  try {
    d.root_ = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}:{}:{}: invalid YAML: {}", source_name, e.mark.line + 1, e.mark.column + 1, e.msg));
  }
  if (d.root_.IsNull() || !d.root_.IsDefined()) d.root_ = YAML::Node(YAML::NodeType::Map);
  if (!d.root_.IsMap()) throw ConfigError(fmt::format("{}:1:1: expected a mapping at the top level", source_name));
  return d;
}

Document Document::load_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("{}: cannot open config file ({})", path, std::strerror(errno)));
  std::stringstream ss;
  ss << in.rdbuf();
  return load_string(ss.str(), path);
}

void Document::apply_override(const std::string& assignment) {
  auto eq = assignment.find('=');
  std::string text = "--set " + assignment;
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(fmt::format("{}: expected KEY=VALUE with a dotted key, e.g. trainer.max_steps=100", text));
  std::string key = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  static const std::regex key_re(R"(^[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z_][A-Za-z0-9_]*|[0-9]+))*$)");
  if (!std::regex_match(key, key_re))
    throw ConfigError(fmt::format("{}: '{}' is not a dotted key (expected e.g. trainer.max_steps)", text, key));
  YAML::Node parsed;
  try {
    parsed = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}: value is not valid YAML: {}", text, e.msg));
  }
  std::vector<std::string> parts;
  std::stringstream ks(key);
  for (std::string p; std::getline(ks, p, '.');) parts.push_back(p);
  // yaml-cpp nodes are handles: walk by re-binding copies, never by assigning through them.
  std::vector<YAML::Node> chain{root_};
  std::string walked;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node cur = chain.back();
    walked += (i ? "." : "") + parts[i];
    if (cur.IsSequence()) {
      size_t idx = std::strtoull(parts[i].c_str(), nullptr, 10);
      if (!std::isdigit(static_cast<unsigned char>(parts[i][0])) || idx >= cur.size())
        throw ConfigError(fmt::format("{}: '{}' is a list; expected an index below {}", text, walked, cur.size()));
      chain.push_back(cur[idx]);
      continue;
    }
    YAML::Node next = cur[parts[i]];
    if (!next.IsDefined() || next.IsNull()) {
      cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
      next = cur[parts[i]];
    } else if (!next.IsMap() && !next.IsSequence()) {
      throw ConfigError(fmt::format("{}: '{}' is a value, not a mapping", text, walked));
    }
    chain.push_back(next);
  }
  YAML::Node parent = chain.back();
  if (parent.IsSequence()) {
    size_t idx = std::strtoull(parts.back().c_str(), nullptr, 10);
    if (idx >= parent.size()) throw ConfigError(fmt::format("{}: list index out of range", text));
    parent[idx] = parsed;
  } else {
    parent[parts.back()] = parsed;
  }
  source_->overrides[key] = text;
}

Section Document::root() { return Section(root_, "", source_); }

std::string Document::emit() const {
  YAML::Emitter out;
  out << root_;
  return std::string(out.c_str()) + "\n";
}

}  // namespace strobe::config
