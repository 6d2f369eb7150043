#include "strobe/config/config.h"
#include "strobe/config/registry.h"

#include <yaml-cpp/eventhandler.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>
#include <sstream>

#include <filesystem>

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

// A default written back into the document keeps its type when the resolved config is emitted and
// read again: a double always has a '.' (yaml-cpp writes 1.0 as "1", which reads back as the
// integer count 1), with the ".0e" form PyYAML needs for exponents; a string is tagged as a string
// so that "32" stays a string.
std::string float_text(double x) {
  std::string s = fmt::format("{}", x);
  auto e = s.find_first_of("eE");
  if (s.find('.') == std::string::npos) {
    if (e == std::string::npos)
      s += ".0";
    else
      s.insert(e, ".0");
  }
  return s;
}

YAML::Node double_node(double x) { return YAML::Node(float_text(x)); }

YAML::Node string_node(const std::string& v) {
  YAML::Node n(v);
  n.SetTag("!");
  return n;
}

std::string parent_path(const std::string& p) {
  auto cut = p.find_last_of(".[");
  return cut == std::string::npos ? std::string() : p.substr(0, cut);
}

// "callbacks.0.patience" -> "callbacks[0].patience", the form Section paths use.
std::string section_path(const std::vector<std::string>& parts) {
  std::string out;
  for (const auto& p : parts) {
    if (!p.empty() && std::isdigit(static_cast<unsigned char>(p[0])))
      out += "[" + p + "]";
    else
      out += (out.empty() ? "" : ".") + p;
  }
  return out;
}

// Aliases make a YAML text a graph: 230 bytes of nested aliases (a "billion laughs") expand to
// billions of nodes, and every walk of the tree (duplicate keys, the schema, the resolved config) pays
// for all of them. Before any walk, count the nodes as they expand and refuse past a bound no real
// experiment comes near; the count stops at the bound, so the check itself is cheap.
constexpr size_t kMaxYamlNodes = 100000;
constexpr int kMaxYamlDepth = 64;

void check_expansion(const YAML::Node& n, const std::string& source, size_t& count, int depth) {
  if (++count > kMaxYamlNodes)
    throw ConfigError(fmt::format("{}: the YAML expands to more than {} nodes (aliases that nest aliases?); a config "
                                  "this large is refused",
                                  source, kMaxYamlNodes));
  if (depth > kMaxYamlDepth) {
    const YAML::Mark m = n.Mark();
    throw ConfigError(fmt::format("{}:{}:{}: nested deeper than {} levels", source, m.line + 1, m.column + 1, kMaxYamlDepth));
  }
  if (n.IsScalar() && n.Scalar().size() > kMaxScalarBytes) {
    const YAML::Mark m = n.Mark();
    throw ConfigError(fmt::format("{}:{}:{}: a value of {} bytes; a value may hold at most {} bytes", source, m.line + 1,
                                  m.column + 1, n.Scalar().size(), kMaxScalarBytes));
  }
  if (n.IsMap()) {
    for (auto it = n.begin(); it != n.end(); ++it) {
      if (it->first.IsScalar() && it->first.Scalar().size() > kMaxKeyChars) {
        const YAML::Mark m = it->first.Mark();
        throw ConfigError(fmt::format("{}:{}:{}: a key of {} characters ('{}'); a key may hold at most {}", source,
                                      m.line + 1, m.column + 1, it->first.Scalar().size(), shown(it->first.Scalar()),
                                      kMaxKeyChars));
      }
      check_expansion(it->first, source, count, depth + 1);
      check_expansion(it->second, source, count, depth + 1);
    }
  } else if (n.IsSequence()) {
    for (auto it = n.begin(); it != n.end(); ++it) check_expansion(*it, source, count, depth + 1);
  }
}

// Where a second YAML document of `text` starts (its first node), if it has one. At most two calls of
// the parser: yaml-cpp's LoadAll loops forever on some malformed input (found by the config fuzzer).
std::optional<YAML::Mark> second_document(const std::string& text) {
  struct FirstNode : YAML::EventHandler {
    std::optional<YAML::Mark> mark;
    void note(const YAML::Mark& m) {
      if (!mark) mark = m;
    }
    void OnDocumentStart(const YAML::Mark&) override {}
    void OnDocumentEnd() override {}
    void OnNull(const YAML::Mark& m, YAML::anchor_t) override { note(m); }
    void OnAlias(const YAML::Mark& m, YAML::anchor_t) override { note(m); }
    void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t, const std::string&) override { note(m); }
    void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override { note(m); }
    void OnSequenceEnd() override {}
    void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override { note(m); }
    void OnMapEnd() override {}
  };
  std::stringstream in(text);
  YAML::Parser parser(in);
  FirstNode first, second;
  if (!parser.HandleNextDocument(first)) return std::nullopt;
  if (!parser.HandleNextDocument(second)) return std::nullopt;
  return second.mark.value_or(YAML::Mark::null_mark());
}

void check_expansion(const YAML::Node& n, const std::string& source) {
  size_t count = 0;
  check_expansion(n, source, count, 0);
}

// yaml-cpp keeps every entry of a mapping that repeats a key and lookups return the first, so a
// repeated key would be silently ignored: refuse it, naming both lines.
void check_duplicate_keys(const YAML::Node& n, const std::string& path, const std::string& source) {
  if (n.IsMap()) {
    std::map<std::string, YAML::Mark> seen;
    for (auto it = n.begin(); it != n.end(); ++it) {
      const std::string key = it->first.IsScalar() ? it->first.Scalar() : std::string();
      const std::string kp = path.empty() ? key : path + "." + key;
      auto [prev, fresh] = seen.emplace(key, it->first.Mark());
      if (!fresh) {
        const YAML::Mark m = it->first.Mark();
        throw ConfigError(fmt::format("{}:{}:{}: {}: duplicate key (first defined at line {})", source, m.line + 1,
                                      m.column + 1, kp, prev->second.line + 1));
      }
      check_duplicate_keys(it->second, kp, source);
    }
  } else if (n.IsSequence()) {
    for (size_t i = 0; i < n.size(); ++i) check_duplicate_keys(n[i], fmt::format("{}[{}]", path, i), source);
  }
}

}  // namespace

bool is_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

namespace {

// Reads a run of characters `ok` accepts from s[i]; returns how many.
template <typename Pred>
size_t eat(std::string_view s, size_t& i, Pred ok) {
  const size_t start = i;
  while (i < s.size() && ok(s[i])) ++i;
  return i - start;
}
bool digit(char c) { return c >= '0' && c <= '9'; }
bool eat_char(std::string_view s, size_t& i, const char* set) {
  if (i < s.size() && s[i] != '\0' && std::strchr(set, s[i])) return ++i, true;
  return false;
}

// [-+]?(\.D+|D+(\.D*)?)([eE][-+]?D+)? where D is `d` (a digit, or a digit or '_' for YAML 1.1),
// with the integer part starting with a digit.
template <typename Pred>
bool is_decimal(std::string_view s, Pred d) {
  size_t i = 0;
  eat_char(s, i, "+-");
  const size_t whole = (i < s.size() && digit(s[i])) ? eat(s, i, d) : 0;
  if (eat_char(s, i, ".")) {
    if (eat(s, i, d) == 0 && whole == 0) return false;
  } else if (whole == 0) {
    return false;
  }
  if (eat_char(s, i, "eE")) {
    eat_char(s, i, "+-");
    if (eat(s, i, digit) == 0) return false;
  }
  return i == s.size();
}

}  // namespace

bool is_int_text(std::string_view s) {
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) s.remove_prefix(1);
  return is_digits(s) && (s.size() == 1 || s[0] != '0');
}

bool is_float_text(std::string_view s) { return is_decimal(s, digit); }

std::string escaped(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (c == '\n') out += "\\n";
      else if (c == '\r') out += "\\r";
      else if (c == '\t') out += "\\t";
      else if (c == 0) out += "\\0";
      else if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
      else out += static_cast<char>(c);
      ++i;
      continue;
    }
    // A well-formed UTF-8 sequence is kept as it is; anything else byte by byte as \xNN.
    const size_t len = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
    bool ok = len > 0 && i + len <= s.size() && (len != 2 || c >= 0xc2);
    for (size_t k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(s[i + k]) & 0xc0) == 0x80;
    if (ok) {
      out.append(s.substr(i, len));
      i += len;
    } else {
      out += fmt::format("\\x{:02x}", c);
      ++i;
    }
  }
  return out;
}

std::string shown(std::string_view s) {
  constexpr size_t kShown = 60;
  std::string e = escaped(s);
  if (e.size() <= kShown) return e;
  size_t cut = kShown;  // never inside a UTF-8 sequence
  while (cut < e.size() && (static_cast<unsigned char>(e[cut]) & 0xc0) == 0x80) ++cut;
  return fmt::format("{}... ({} characters)", e.substr(0, cut), s.size());
}

namespace {

// A key of a mapping or a dotted path: an identifier, or an index after the first segment.
bool is_identifier(std::string_view s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

}  // namespace

}  // namespace strobe::config

namespace strobe {
RegistrationLog*& current_registration_log() {
  static RegistrationLog* log = nullptr;
  return log;
}
}  // namespace strobe

namespace strobe::config {

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
  for (std::string p = kp; !p.empty(); p = parent_path(p)) {
    auto it = source_->overrides.find(p);
    if (it != source_->overrides.end()) return it->second;
  }
  YAML::Mark mark = YAML::Mark::null_mark();
  bool key_found = false;
  if (!key.empty() && node_.IsMap()) {
    for (auto it = node_.begin(); it != node_.end(); ++it) {
      if (it->first.Scalar() == key) {
        mark = it->first.Mark();
        key_found = true;
        break;
      }
    }
  }
  if (key_found && mark.is_null()) {
    // A key the file does not have was made by a --set of a key below it (--set foo.bar=3 makes foo).
    for (const auto& [path, text] : source_->overrides)
      if (path.rfind(kp + ".", 0) == 0 || path.rfind(kp + "[", 0) == 0) return text;
  }
  if (mark.is_null() && node_.IsDefined()) mark = node_.Mark();
  // A key a later config file gave (Document::load_files): that file's line and column.
  std::string file = source_->file;
  for (std::string p = key_found ? kp : path_; !p.empty(); p = parent_path(p)) {
    auto it = source_->files.find(p);
    if (it != source_->files.end()) {
      file = it->second;
      break;
    }
  }
  if (mark.is_null() || mark.line < 0) return file;
  return fmt::format("{}:{}:{}", file, mark.line + 1, mark.column + 1);
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
  if (!is_int_text(s)) fail(key, fmt::format("expected an integer{}, got '{}'", range(), shown(s)));
  errno = 0;
  long long x = std::strtoll(s.c_str(), nullptr, 10);
  if (errno == ERANGE || x < min || x > max) fail(key, fmt::format("expected an integer{}, got {}", range(), shown(s)));
  return x;
}

double Section::get_double(const std::string& key, double def, double min, double max) {
  known_.insert(key);
  if (is_null(key)) {
    node_[key] = double_node(def);
    return def;
  }
  YAML::Node v = scalar(key, "a number");
  const std::string& s = v.Scalar();
  if (!is_float_text(s)) fail(key, fmt::format("expected a number, got '{}'", shown(s)));
  double x = std::strtod(s.c_str(), nullptr);
  if (!std::isfinite(x) || x < min || x > max) {
    std::string range = max < 1e308 ? fmt::format("in [{}, {}]", min, max) : fmt::format(">= {}", min);
    fail(key, fmt::format("expected a number {}, got {}", range, shown(s)));
  }
  return x;
}

std::string Section::get_string(const std::string& key, const std::string& def) {
  known_.insert(key);
  if (is_null(key)) {
    node_[key] = string_node(def);
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
  fail(key, fmt::format("expected one of {}, got '{}'{}", join(choices), shown(v),
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
    if (!e.IsScalar() || !is_int_text(e.Scalar()))
      fail(key, fmt::format("expected a list of integers, got element '{}'", e.IsScalar() ? shown(e.Scalar()) : "?"));
    errno = 0;
    out.push_back(std::strtoll(e.Scalar().c_str(), nullptr, 10));
    if (errno == ERANGE) fail(key, fmt::format("expected a list of integers, got element {}", shown(e.Scalar())));
  }
  return out;
}

CountOrFraction Section::get_count_or_fraction(const std::string& key, CountOrFraction def) {
  known_.insert(key);
  if (is_null(key)) {
    if (def.is_count)
      node_[key] = def.count;
    else
      node_[key] = double_node(def.fraction);
    return def;
  }
  const std::string& s = scalar(key, "an integer count or a fraction").Scalar();
  CountOrFraction r;
  if (is_int_text(s)) {
    r.is_count = true;
    errno = 0;
    r.count = std::strtoll(s.c_str(), nullptr, 10);
    if (r.count < 0 || errno == ERANGE)
      fail(key, fmt::format("expected a count >= 0 or a fraction in [0, 1], got {}", shown(s)));
    return r;
  }
  if (is_float_text(s)) {
    r.fraction = std::strtod(s.c_str(), nullptr);
    if (r.fraction < 0.0 || r.fraction > 1.0)
      fail(key, fmt::format("expected a count >= 0 or a fraction in [0, 1], got {}", shown(s)));
    return r;
  }
  fail(key, fmt::format("expected an integer count or a fraction in [0, 1], got '{}'", shown(s)));
}

Section Section::child(const std::string& key) {
  known_.insert(key);
  if (is_null(key)) node_[key] = YAML::Node(YAML::NodeType::Map);
  YAML::Node v = node_[key];
  if (!v.IsMap()) fail(key, "expected a mapping of keys");
  return Section(v, key_path(key), source_);
}

std::vector<Section> Section::list(const std::string& key, const std::string& element) {
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
    if (!e.IsMap()) s.fail_here("expected " + element);
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
    // A second document (after a '---' or '...' line) would be ignored: refused, naming its line.
    if (const auto second = second_document(text))
      throw ConfigError(fmt::format("{}{}: a second YAML document (after a '---' or '...' line); a config is one document",
                                    source_name, second->is_null() ? "" : fmt::format(":{}:{}", second->line + 1, second->column + 1)));
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}:{}:{}: invalid YAML: {}", source_name, e.mark.line + 1, e.mark.column + 1, e.msg));
  }
  if (d.root_.IsNull() || !d.root_.IsDefined())
    throw ConfigError(fmt::format("{}: the config is empty (expected a mapping with at least 'model' and 'data')", source_name));
  if (!d.root_.IsMap()) throw ConfigError(fmt::format("{}:1:1: expected a mapping at the top level", source_name));
  check_expansion(d.root_, source_name);
  check_duplicate_keys(d.root_, "", source_name);
  return d;
}

Document Document::clone() const {
  Document d = *this;
  // reset rebinds d's handle: assigning (d.root_ = ...) would make the node both handles share take
  // the clone's contents, so this document would then see every override applied to the copy.
  d.root_.reset(YAML::Clone(root_));
  d.source_ = std::make_shared<SourceInfo>(*source_);
  return d;
}

Document Document::load_files(const std::vector<std::string>& paths) {
  Document doc = load_file(paths.at(0));
  for (size_t i = 1; i < paths.size(); ++i) {
    const Document next = load_file(paths[i]);
    YAML::Node over = next.root_;
    // A later file's plugins are relative to that file, as the first file's are to it.
    if (over["plugins"].IsDefined() && over["plugins"].IsSequence()) {
      const auto dir = std::filesystem::absolute(paths[i]).parent_path();
      for (size_t k = 0; k < over["plugins"].size(); ++k) {
        YAML::Node p = over["plugins"][k];
        if (p.IsScalar() && !p.Scalar().empty() && p.Scalar()[0] != '/') p = (dir / p.Scalar()).lexically_normal().string();
        if (p.IsMap() && p["path"].IsScalar() && !p["path"].Scalar().empty() && p["path"].Scalar()[0] != '/')
          p["path"] = (dir / p["path"].Scalar()).lexically_normal().string();
      }
    }
    doc.merge(doc.root_, over, "", paths[i]);
  }
  return doc;
}

void Document::merge(YAML::Node base, const YAML::Node& over, const std::string& path, const std::string& file) {
  // Another component by name: the earlier files' keys of that section go before the merge.
  if (!path.empty() && base["name"].IsDefined() && base["name"].IsScalar() && over["name"].IsDefined() &&
      over["name"].IsScalar() && base["name"].Scalar() != over["name"].Scalar())
    drop_component_keys(base, path, base["name"].Scalar(), fmt::format("{} sets {}.name: {}", file, path, over["name"].Scalar()));
  for (auto it = over.begin(); it != over.end(); ++it) {
    const std::string key = it->first.Scalar();
    const std::string kp = path.empty() ? key : path + "." + key;
    YAML::Node mine = base[key];
    if (mine.IsDefined() && mine.IsMap() && it->second.IsMap()) {
      merge(mine, it->second, kp, file);
      continue;
    }
    // A value or a list replaces the earlier one; the key node comes along, so its errors point here.
    base.remove(key);
    base.force_insert(it->first, it->second);
    source_->files[kp] = file;
    for (auto f = source_->files.begin(); f != source_->files.end();)  // what was below it is gone
      f = (f->first.rfind(kp + ".", 0) == 0 || f->first.rfind(kp + "[", 0) == 0) ? source_->files.erase(f) : std::next(f);
  }
}

Document Document::load_file(const std::string& path) {
  // Non-blocking open, then fstat: a FIFO without a writer or a device never blocks the open. A
  // regular file and a pipe (`-c <(cmd)`, `-c /dev/stdin`) are read, at most kMaxConfigBytes; any
  // other kind (/dev/zero, a socket) is refused before a byte is read.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == EISDIR) throw ConfigError(fmt::format("{}: is a directory, not a config file", path));
    throw ConfigError(fmt::format("{}: cannot open config file ({})", path, std::strerror(errno)));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw ConfigError(fmt::format("{}: cannot read config file ({})", path, std::strerror(errno)));
  if (S_ISDIR(st.st_mode)) throw ConfigError(fmt::format("{}: is a directory, not a config file", path));
  if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode))
    throw ConfigError(fmt::format("{}: is not a regular file or a pipe (a device?): a config is read from a file or a pipe",
                                  path));
  const auto too_large = [&] {
    return ConfigError(fmt::format("{}: more than {} bytes; a config file may hold at most {} bytes", path, kMaxConfigBytes,
                                   kMaxConfigBytes));
  };
  if (S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) > kMaxConfigBytes) throw too_large();
  // A pipe is read blocking: its writer may not have written yet (EOF comes when every writer is gone).
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  std::string text;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw ConfigError(fmt::format("{}: cannot read config file ({})", path, std::strerror(errno)));
    }
    if (n == 0) break;
    if (text.size() + static_cast<size_t>(n) > kMaxConfigBytes) throw too_large();
    text.append(buf, static_cast<size_t>(n));
  }
  return load_string(text, path);
}

void Document::apply_override(const std::string& assignment) {
  auto eq = assignment.find('=');
  // The --set as messages name it: whole (escaped: the message stays one line), unless it is too
  // long to read on one line.
  const std::string text = "--set " + (assignment.size() > 1000 ? shown(assignment) : escaped(assignment));
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(fmt::format("{}: expected KEY=VALUE with a dotted key, e.g. trainer.max_steps=100", text));
  std::string key = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  // An empty value would parse as null, i.e. silently mean the default.
  if (value.find_first_not_of(" \t") == std::string::npos)
    throw ConfigError(fmt::format("{}: empty value (to reset a key to its default write {}=null)", text, shown(key)));
  // The bounds first: nothing below reads more than they allow (docs/CONFIG.md, "Limits").
  if (value.size() > kMaxScalarBytes)
    throw ConfigError(fmt::format("{}: a value of {} bytes; a value may hold at most {} bytes", text, value.size(),
                                  kMaxScalarBytes));
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t dot = key.find('.', at);
    const size_t end = dot == std::string::npos ? key.size() : dot;
    if (parts.size() == kMaxKeyDepth)
      throw ConfigError(fmt::format("{}: a key of more than {} dotted parts", text, kMaxKeyDepth));
    const std::string_view part(key.data() + at, end - at);
    if (part.size() > kMaxKeyChars)
      throw ConfigError(fmt::format("{}: a key part of {} characters ('{}'); a key may hold at most {}", text,
                                    part.size(), shown(part), kMaxKeyChars));
    if (!(is_identifier(part) || (!parts.empty() && is_digits(part))))
      throw ConfigError(fmt::format("{}: '{}' is not a dotted key (expected e.g. trainer.max_steps)", text, shown(key)));
    parts.emplace_back(part);
    if (dot == std::string::npos) break;
    at = dot + 1;
  }
  YAML::Node parsed;
  size_t documents = 0;
  try {
    parsed = YAML::Load(value);
    documents = second_document(value) ? 2 : (parsed.IsDefined() && !parsed.IsNull()) ? 1 : 0;
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}: value is not valid YAML: {}", text, e.msg));
  }
  // A value YAML reads as no value at all ('---', '...', '# x': a marker or a comment) would silently
  // mean the default; only a null spelt out means that.
  const std::string trimmed = value.substr(value.find_first_not_of(" \t"));
  static const std::set<std::string> nulls = {"null", "Null", "NULL", "~"};
  if (documents > 1)
    throw ConfigError(fmt::format("{}: YAML reads the value as two documents (a '---' or '...' line inside it); quote it", text));
  if ((documents == 0 || parsed.IsNull()) && !nulls.count(trimmed.substr(0, trimmed.find_last_not_of(" \t") + 1)))
    throw ConfigError(fmt::format("{}: YAML reads the value as no value (a document marker or a comment); quote it ({}='\"{}\"'), "
                                  "or write {}=null for the default",
                                  text, shown(key), shown(value), shown(key)));
  check_expansion(parsed, text);
  try {
    check_duplicate_keys(parsed, key, text);
  } catch (const ConfigError& e) {
    // The value's own positions mean nothing on a command line: name the --set only.
    std::string what = e.what();
    throw ConfigError(text + what.substr(what.find(": ", text.size() + 1)));
  }
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
  // Another component by name (`--set scheduler.name=none`): the keys the old one's section got from
  // the files belong to it and go, saying so; keys an earlier --set gave stay (a typo still fails).
  if (parts.size() > 1 && parts.back() == "name" && parent.IsMap()) {
    const YAML::Node old = parent["name"];
    if (old.IsDefined() && old.IsScalar() && parsed.IsScalar() && old.Scalar() != parsed.Scalar()) {
      const std::string section = section_path(std::vector<std::string>(parts.begin(), parts.end() - 1));
      drop_component_keys(parent, section, old.Scalar(), text);
    }
  }
  if (parent.IsSequence()) {
    size_t idx = std::strtoull(parts.back().c_str(), nullptr, 10);
    if (idx >= parent.size()) throw ConfigError(fmt::format("{}: list index out of range", text));
    parent[idx] = parsed;
  } else {
    parent[parts.back()] = parsed;
  }
  source_->overrides[section_path(parts)] = text;
}

void Document::drop_component_keys(YAML::Node section, const std::string& path, const std::string& old_name,
                                   const std::string& because) {
  std::vector<std::string> keys, dropped;
  for (auto it = section.begin(); it != section.end(); ++it) keys.push_back(it->first.Scalar());
  for (const auto& k : keys) {
    if (k == "name") continue;
    const std::string kp = path + "." + k;
    bool given = false;  // by a --set: of the key, below it, or of the whole section
    for (const auto& [set_path, t] : source_->overrides)
      given |= set_path == kp || set_path == path || set_path.rfind(kp + ".", 0) == 0 || set_path.rfind(kp + "[", 0) == 0;
    if (given) continue;
    section.remove(k);
    dropped.push_back(kp);
  }
  if (dropped.empty()) return;
  std::string list, files;
  for (size_t i = 0; i < dropped.size(); ++i) {
    list += (i ? ", " : "") + dropped[i];
    std::string file = source_->file;  // the file each key came from (a later one of load_files, or the first)
    for (std::string p = dropped[i]; !p.empty(); p = parent_path(p))
      if (auto it = source_->files.find(p); it != source_->files.end()) {
        file = it->second;
        break;
      }
    if (files.find(file) == std::string::npos) files += (files.empty() ? "" : ", ") + file;
  }
  notes_.push_back(fmt::format("{}: dropped {} ({}'s keys from {})", because, list, old_name, files));
}

Section Document::root() { return Section(root_, "", source_); }

namespace {

// YAML 1.1 and 1.2 core-schema resolution of a plain scalar: what a reader (yaml-cpp, PyYAML,
// ruamel) would take it for if it were written without quotes. Without std::regex: a value may be
// 64 KiB long (see is_int_text).
bool plain_reads_as_non_string(const std::string& s) {
  static const std::set<std::string> words = {"~",   "null", "Null", "NULL", "y",     "Y",     "yes",   "Yes",
                                              "YES", "n",    "N",    "no",   "No",    "NO",    "true",  "True",
                                              "TRUE", "false", "False", "FALSE", "on", "On", "ON", "off", "Off", "OFF",
                                              ".nan", ".NaN", ".NAN"};
  if (s.empty() || words.count(s)) return true;
  std::string_view v(s);
  auto digit_ = [](char c) { return digit(c) || c == '_'; };
  auto all = [](std::string_view t, auto ok) { return !t.empty() && std::all_of(t.begin(), t.end(), ok); };
  // [-+]? then an integer in base 10 (with '_'), 8 (0 or 0o prefix), 16 (0x) or 2 (0b), or .inf.
  std::string_view u = v;
  if (u[0] == '+' || u[0] == '-') u.remove_prefix(1);
  if (u == ".inf" || u == ".Inf" || u == ".INF") return true;
  if (u == "0" || (!u.empty() && u[0] >= '1' && u[0] <= '9' && all(u, digit_))) return true;
  auto octal = [](char c) { return c >= '0' && c <= '7'; };
  if (u.size() > 1 && u[0] == '0' && all(u.substr(1), octal)) return true;
  if (u.size() > 2 && u[0] == '0') {
    const std::string_view body = u.substr(2);
    if (u[1] == 'o' && all(body, octal)) return true;
    if (u[1] == 'x' && all(body, [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; })) return true;
    if (u[1] == 'b' && all(body, [](char c) { return c == '0' || c == '1'; })) return true;
  }
  // A decimal number (YAML 1.1 allows '_' in its digits).
  if (is_decimal(v, digit_)) return true;
  // Sexagesimal (YAML 1.1): [0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?
  size_t i = 0;
  if (!digit(v[0])) return false;
  eat(v, i, digit_);
  size_t groups = 0;
  while (i < v.size() && v[i] == ':') {
    ++i;
    if (i == v.size() || !digit(v[i])) return false;
    const char first = v[i++];
    if (first <= '5' && i < v.size() && digit(v[i])) ++i;
    ++groups;
  }
  if (groups == 0) return false;
  if (eat_char(v, i, ".")) eat(v, i, digit_);
  return i == v.size();
}

// [-+]?[0-9]*\.[0-9]{15,}: a double written with yaml-cpp's 17 digits.
bool is_long_float(std::string_view s) {
  size_t i = 0;
  eat_char(s, i, "+-");
  eat(s, i, digit);
  if (!eat_char(s, i, ".")) return false;
  return eat(s, i, digit) >= 15 && i == s.size();
}

void emit_node(YAML::Emitter& out, const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Map:
      if (n.Style() == YAML::EmitterStyle::Flow || n.size() == 0) out << YAML::Flow;
      out << YAML::BeginMap;
      for (auto it = n.begin(); it != n.end(); ++it) {
        out << YAML::Key;
        emit_node(out, it->first);
        out << YAML::Value;
        emit_node(out, it->second);
      }
      out << YAML::EndMap;
      break;
    case YAML::NodeType::Sequence:
      if (n.Style() == YAML::EmitterStyle::Flow || n.size() == 0) out << YAML::Flow;
      out << YAML::BeginSeq;
      for (const auto& e : n) emit_node(out, e);
      out << YAML::EndSeq;
      break;
    case YAML::NodeType::Scalar:
      // A quoted scalar in the file (tag "!") or a string default stays a string: quoted when its
      // text would otherwise read as a number, a boolean or null ("32", "1.0", "yes").
      if (n.Tag() == "!" && plain_reads_as_non_string(n.Scalar()))
        out << YAML::DoubleQuoted << n.Scalar();
      else if (n.Tag().empty() && is_long_float(n.Scalar()))
        // A double a component stored with yaml-cpp's 17 digits (0.90000000000000002): the shortest
        // text that reads back as the same double.
        out << float_text(std::strtod(n.Scalar().c_str(), nullptr));
      else
        out << n.Scalar();
      break;
    default:
      out << YAML::Null;
  }
}

}  // namespace

std::string Document::emit() const {
  YAML::Emitter out;
  emit_node(out, root_);
  return std::string(out.c_str()) + "\n";
}

}  // namespace strobe::config
