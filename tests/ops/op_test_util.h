// Shared by the operator tests (tests/ops, tests/gpu_*): the relative error against a float64
// reference, float8 operands' float64 values, and the check that a call fails with a clear message.
#pragma once

#include <cmath>
#include <functional>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"

namespace strobe::testing {

// ||got - want|| / ||want|| in float64 on the CPU (||got - want|| when want is 0); INFINITY for NaN.
inline double rel_err(const torch::Tensor& got, const torch::Tensor& want) {
  const torch::Tensor w = want.to(torch::kCPU, torch::kDouble), g = got.to(torch::kCPU, torch::kDouble);
  const double num = (g - w).norm().item<double>(), den = w.norm().item<double>();
  if (std::isnan(num)) return INFINITY;
  return den == 0 ? num : num / den;
}

// The float64 value of strobe::ops::fp8_quantize's copy of t in `format` (quantized on the CPU, as a
// 2-D [-1, last dim] view), in t's shape: the operands a scaled GEMM multiplies.
inline torch::Tensor fp8_dequantized(const torch::Tensor& t, torch::ScalarType format) {
  const torch::Tensor t2 = t.cpu().reshape({-1, t.size(-1)});
  const auto [q, q_t, scale_inv] = strobe::ops::fp8_quantize(t2, format, false);
  return (q.to(torch::kDouble) * scale_inv.to(torch::kDouble)).view(t.sizes());
}

// f must throw a c10::Error whose message contains `text`.
inline void expect_error(const std::function<void()>& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << text << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

}  // namespace strobe::testing
