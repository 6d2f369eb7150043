// trainer.precision as a type (docs/ARCHITECTURE.md, "Precision"): parsed once from the YAML, then
// compared as an enum everywhere; its YAML spelling is written back only where text is stored
// (config.yaml, a checkpoint's meta, a capture's summary).
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace strobe {

enum class Precision {
  k32,          // "32": fp32 weights and activations
  kBf16Mixed,   // "bf16-mixed": fp32 weights, bf16 autocast
  k16Mixed,     // "16-mixed": fp32 weights, fp16 autocast, dynamic loss scaling (CUDA)
  kBf16Master,  // "bf16-master": bf16 weights, fp32 master copies, no autocast
};

// The YAML spelling.
constexpr const char* to_string(Precision p) {
  switch (p) {
    case Precision::k32: return "32";
    case Precision::kBf16Mixed: return "bf16-mixed";
    case Precision::k16Mixed: return "16-mixed";
    case Precision::kBf16Master: return "bf16-master";
  }
  return "?";
}

// From the YAML spelling; std::invalid_argument for any other text.
inline Precision parse_precision(std::string_view text) {
  for (Precision p : {Precision::k32, Precision::kBf16Mixed, Precision::k16Mixed, Precision::kBf16Master})
    if (text == to_string(p)) return p;
  throw std::invalid_argument("unknown precision '" + std::string(text) + "' (32, bf16-mixed, 16-mixed, bf16-master)");
}

// Whether the forward runs under autocast (the two mixed precisions).
constexpr bool autocasts(Precision p) { return p == Precision::kBf16Mixed || p == Precision::k16Mixed; }

}  // namespace strobe
