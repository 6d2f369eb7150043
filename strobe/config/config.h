// Config: YAML experiment files read into typed, validated values.
//
// Contract: every value is read through a Section, which knows the dotted path of the key and the
// file/line/column it came from (or the --set override that produced it). Any problem — unknown key
// (with a did-you-mean), wrong type, out-of-range value, missing required key — throws ConfigError
// whose message is one line: "<file>:<line>:<col>: <key path>: <what was expected>". Defaults that a
// reader applies are written back into the document, so emit() yields the fully resolved config.
// This library needs no torch: the libFuzzer target links it alone.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <yaml-cpp/yaml.h>

namespace strobe::config {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What a config may hold (docs/CONFIG.md, "Limits"): longer input is refused with one line naming
// where it is, before anything else reads it.
constexpr size_t kMaxScalarBytes = 64 * 1024;  // one value (a YAML scalar, a --set value)
constexpr size_t kMaxKeyChars = 128;           // one key, or one segment of a dotted --set key
constexpr size_t kMaxKeyDepth = 64;            // segments of a dotted --set key (the YAML nesting bound)
constexpr size_t kMaxRunNameBytes = 128;       // the run's `name` (a directory name)
constexpr size_t kMaxConfigBytes = 4 << 20;    // a config file (-c), or what a pipe given to -c carries

// Plain text tests, in time linear in the text and constant stack (std::regex recurses per
// character and overflows the stack on long input): an optionally signed decimal integer without
// leading zeros ("-12"), a decimal number ("1.5e-3", ".5", "2."), a run of ASCII digits ("007").
bool is_int_text(std::string_view s);
bool is_float_text(std::string_view s);
bool is_digits(std::string_view s);
// Text as a one-line message can show it: control characters escaped (\n, \t, \0, \xNN) and bytes
// that are not UTF-8 as \xNN; well-formed UTF-8 kept.
std::string escaped(std::string_view s);
// A value as a message shows it: escaped, whole when short, else its start and its length.
std::string shown(std::string_view s);

// Where the values of a document came from: the file, and which dotted paths --set replaced.
struct SourceInfo {
  std::string file;                               // the first (or only) config file
  std::map<std::string, std::string> overrides;  // dotted path -> the "--set a.b=c" text
  std::map<std::string, std::string> files;      // dotted path -> a later config file it came from
};

// A value that YAML writes either as an integer (a count) or as a float (a fraction), like
// Lightning's limit_train_batches / val_check_interval.
struct CountOrFraction {
  bool is_count = false;
  int64_t count = 0;
  double fraction = 1.0;
  // Number of items out of `total` this selects (fraction rounded down, at least 1 when > 0).
  int64_t resolve(int64_t total) const;
};

class Section {
 public:
  Section() = default;
  Section(YAML::Node node, std::string path, std::shared_ptr<SourceInfo> source);

  bool has(const std::string& key) const;
  bool is_null(const std::string& key) const;

  // Typed reads. The default is stored into the document when the key is absent.
  bool get_bool(const std::string& key, bool def);
  int64_t get_int(const std::string& key, int64_t def, int64_t min = INT64_MIN, int64_t max = INT64_MAX);
  double get_double(const std::string& key, double def, double min = -1e308, double max = 1e308);
  std::string get_string(const std::string& key, const std::string& def);
  // One of `choices`; the error lists them (and suggests the closest).
  std::string get_choice(const std::string& key, const std::string& def, const std::vector<std::string>& choices);
  std::optional<std::string> get_optional_string(const std::string& key);
  std::vector<int64_t> get_int_list(const std::string& key, const std::vector<int64_t>& def);
  CountOrFraction get_count_or_fraction(const std::string& key, CountOrFraction def);
  std::string require_string(const std::string& key);

  // A nested mapping (created empty when absent) and a sequence of mappings.
  Section child(const std::string& key);
  std::vector<Section> list(const std::string& key, const std::string& element = "a mapping with a 'name'");

  // Marks keys as known without reading them (e.g. `name`, read by the registry).
  void accept(const std::string& key) { known_.insert(key); }
  // Every key present that was not read is an error (with a did-you-mean among the known keys).
  void finish() const;

  [[noreturn]] void fail(const std::string& key, const std::string& what) const;
  [[noreturn]] void fail_here(const std::string& what) const;
  std::string key_path(const std::string& key) const;
  const std::string& path() const { return path_; }
  YAML::Node node() const { return node_; }
  std::string location(const std::string& key) const;  // "file:line:col" or "--set ..."

 private:
  YAML::Node scalar(const std::string& key, const char* expected);
  YAML::Node node_;
  std::string path_;
  std::shared_ptr<SourceInfo> source_;
  std::set<std::string> known_;
};

// A YAML experiment document.
class Document {
 public:
  static Document load_file(const std::string& path);
  // Several config files composed in order, as LightningCLI's repeated --config: a later file's
  // mappings merge into the earlier ones key by key, its lists and values replace, and a section whose
  // `name` it changes loses the earlier files' keys (a note says which). Each key's errors name the
  // file, line and column it came from. `paths` holds at least one file.
  static Document load_files(const std::vector<std::string>& paths);
  static Document load_string(const std::string& text, const std::string& source_name);
  // A deep copy: overrides applied to it never reach this one.
  Document clone() const;
  // "a.b.c=value": value parsed as YAML; intermediate mappings are created. Bad syntax throws. A
  // changed component name ("scheduler.name=none") drops the keys the old component's section got
  // from the files (not those an earlier override gave), adding a line to notes().
  void apply_override(const std::string& assignment);
  // What composing the document did that a user should read (one line each): keys dropped with a
  // component that another name replaced.
  const std::vector<std::string>& notes() const { return notes_; }
  Section root();
  std::string emit() const;
  const std::string& file() const { return source_->file; }

 private:
  void merge(YAML::Node base, const YAML::Node& over, const std::string& path, const std::string& file);
  void drop_component_keys(YAML::Node section, const std::string& path, const std::string& old_name, const std::string& because);
  YAML::Node root_;
  std::shared_ptr<SourceInfo> source_;
  std::vector<std::string> notes_;
};

// Closest candidate within a small edit distance, or "" when nothing is close.
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace strobe::config
