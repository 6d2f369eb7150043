#include "runner/init_from.h"

#include <map>
#include <string>

#include <fmt/format.h>
#include <torch/torch.h>

#include "framework/checkpoint/checkpoint_io.h"
#include "framework/checkpoint/safetensors.h"
#include "framework/core/weight_names.h"

namespace strobe {

void load_init_from(Model& model, config::Section& model_cfg, const config::InitFrom& f, bool speaks) {
  const std::string family = model_cfg.node()["name"].Scalar();
  config::Section init = model_cfg.child("init_from");  // errors name the key and where it was set
  NameMap map;
  try {
    map = make_name_map(family, f.names, model);
  } catch (const WeightNamesError& e) {
    init.fail("names", e.what());
  }
  safetensors::File file;
  try {
    file = safetensors::read_file(f.path);
  } catch (const checkpoint::CheckpointError& e) {
    init.fail("path", e.what());  // "PATH: not a safetensors file: ..." / "PATH: cannot open (...)"
  }
  std::map<std::string, torch::Tensor> tensors;
  for (auto& [name, t] : file.tensors) tensors.emplace(name, std::move(t));
  const WeightsFit fit = load_named_weights(model, map, tensors, f.ignore, !f.strict);
  const std::string what = fmt::format("{} ({} names)", f.path, f.names);
  if (!fit.ok() && f.strict)
    model_cfg.fail("init_from", fmt::format("{} does not fit model '{}': {}; leave names out with "
                                            "model.init_from.ignore (globs such as \"head.*\") or load what fits "
                                            "with model.init_from.strict: false",
                                            what, family, fit.describe()));
  if (!speaks) return;
  if (!fit.ok()) fmt::print(stderr, "strobe: warning: model.init_from: {} does not fit model '{}' (strict: false): {}\n",
                            what, family, fit.describe());
  // What `ignore` left out, the first ten by name (an error lists every name; this is a note).
  std::string ignored;
  for (size_t i = 0; i < fit.ignored.size() && i < 10; ++i) ignored += (i ? ", " : "") + fit.ignored[i];
  if (fit.ignored.size() > 10) ignored += fmt::format(" and {} more", fit.ignored.size() - 10);
  fmt::print("strobe: model.init_from: {} tensors loaded from {}{}\n", fit.loaded, what,
             fit.ignored.empty() ? "" : fmt::format("; ignored {}: {}", fit.ignored.size(), ignored));
  std::fflush(stdout);
}

}  // namespace strobe
