// libFuzzer target for the config loader (no torch): arbitrary bytes as an experiment file, plus the
// reads every component does. A ConfigError is the expected answer to bad input; anything else — a
// crash, another exception, a hang, a leak — is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "strobe/config/experiment.h"
#include "strobe/config/experiment_parse.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strobe::config;
  std::string text(reinterpret_cast<const char*>(data), size);
  try {
    Document doc = Document::load_string(text, "fuzz.yaml");
    // A --set taken from the first line, when it looks like one.
    auto nl = text.find('\n');
    std::string first = text.substr(0, nl);
    if (first.rfind("#set ", 0) == 0) doc.apply_override(first.substr(5));
    Experiment e = parse_experiment(doc);
    e.model.accept("name");
    e.model.get_int("depth", 18, 1, 200);
    e.model.get_double("mlp_ratio", 4.0, 0.0);
    e.model.get_choice("attention", "math", {"custom", "sdpa", "math"});
    e.model.get_choice("fused_ops", "auto", {"auto", "true", "false"});
    e.model.get_choice("gelu", "erf", {"erf", "tanh"});
    e.model.get_int_list("milestones", {1, 2});
    e.model.get_optional_string("checkpoint");
    e.model.child("extra").get_bool("flag", false);
    for (auto& cb : e.callbacks) {
      cb.accept("name");
      cb.get_string("monitor", "val/loss");
      cb.get_count_or_fraction("every", {false, 0, 1.0});
    }
    e.model.finish();
    (void)doc.emit();
  } catch (const ConfigError&) {
  }
  return 0;
}
