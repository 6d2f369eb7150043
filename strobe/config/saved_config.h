// A checkpoint's resolved config (its "config" entry, strobe/checkpoint/checkpoint_keys.h), parsed
// once per command and shared by what reads it: the plugins it was written with, the model it
// builds (strobe export), and its leaves for the resume check (config::compare_for_resume).
#pragma once

#include <string>
#include <vector>

#include "strobe/config/config.h"
#include "strobe/config/experiment.h"
#include "strobe/config/resume_check.h"

namespace strobe::config {

class SavedConfig {
 public:
  // Throws ConfigError naming `source` (and the line) when `text` is not one YAML mapping.
  SavedConfig(std::string text, std::string source);

  const std::string& text() const { return text_; }
  const std::string& source() const { return doc_.file(); }
  // A copy of the document, to build a component from or to override: this one never changes.
  Document document() const { return doc_.clone(); }
  // Its `plugins:` entries, named by recorded_by (not a line of YAML). Throws ConfigError for an entry
  // that is neither a path nor {path, sha256}.
  std::vector<PluginSpec> plugins() const;
  // The one flattening of it (config::flatten_config).
  const ConfigLeaves& leaves() const { return leaves_; }
  // One leaf's text ("true", "[32, 16]"), "" when absent.
  std::string leaf(const std::string& path) const;
  // One top-level section as YAML text ("" when absent), e.g. the model section export records.
  std::string section_yaml(const std::string& key) const;

 private:
  std::string text_;
  Document doc_;
  YAML::Node root_;  // doc_'s root, read through a const reference (a lookup never inserts)
  ConfigLeaves leaves_;
};

}  // namespace strobe::config
