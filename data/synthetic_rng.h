// A small PRNG for synthetic datasets: seeded from the loader's per-sample generator (so a sample
// stays a pure function of (seed, epoch, index)) plus a per-split salt (so val/test differ from
// train), and cheap enough to draw a whole image in a worker thread.
#pragma once

#include <cmath>
#include <cstdint>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

namespace strobe::data {

class SampleRng {
 public:
  SampleRng(at::Generator& gen, uint64_t salt) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state_ = gen.get<at::CPUGeneratorImpl>()->random64() ^ (salt * 0x9E3779B97F4A7C15ull);
  }
  uint64_t next() {  // SplitMix64
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform integer in [lo, hi).
  int64_t uniform_int(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo)); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double normal() {  // Box-Muller
    double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1 > 0 ? u1 : 1e-300)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace strobe::data
