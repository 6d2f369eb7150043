// fit_text: `strobe fit` of a config given as text, as the data tests' resume checks run it: the
// document parsed, trainer.max_steps set, in run_dir, resuming from ckpt when given; returns fit's
// exit status.
#pragma once

#include <optional>
#include <string>

#include "runner/experiment_builder.h"
#include "strobe/config/config.h"
#include "strobe/core/trainer.h"

namespace strobe::testing {

inline int fit_text(const std::string& text, const std::string& run_dir, std::optional<std::string> ckpt, int max_steps) {
  auto doc = config::Document::load_string(text, "test.yaml");
  doc.apply_override("trainer.max_steps=" + std::to_string(max_steps));
  RunOptions opt;
  opt.run_dir = run_dir;
  opt.ckpt = std::move(ckpt);
  auto run = build_run(doc, opt);
  return run->trainer->fit(std::move(run->checkpoint));
}

}  // namespace strobe::testing
