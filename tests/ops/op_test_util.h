// Shared by the operator tests (tests/ops, tests/gpu_*): the relative error against a float64
// reference, float8 operands' float64 values, the check that a call fails with a clear message, and the
// norms' amax variants against the plain ops (CPU and CUDA).
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

// add_layer_norm_amax / add_rms_norm_amax: (sum, y) and the gradients bit for bit those of
// add_layer_norm / add_rms_norm, y_amax = max |y| exactly (NaN when y holds one; 0 for RMSNorm of zeros), not
// differentiable.
inline void check_norm_amax(const torch::Device& dev, torch::ScalarType dt, int64_t rows, int64_t cols, const std::string& what) {
  auto same = [](const torch::Tensor& a, const torch::Tensor& b) {  // bitwise, NaN for NaN
    return a.sizes() == b.sizes() && torch::equal(torch::isnan(a), torch::isnan(b)) &&
           torch::equal(torch::nan_to_num(a.to(torch::kDouble), 0.0), torch::nan_to_num(b.to(torch::kDouble), 0.0));
  };
  for (int kind = 0; kind < 3; ++kind) {  // 0: random, 1: a NaN, 2: zeros
    for (bool rms : {false, true}) {
      const std::string w_ = what + (rms ? " rms" : " layer") + (kind == 1 ? " nan" : kind == 2 ? " zeros" : "");
      torch::manual_seed(rows + cols + kind);
      torch::Tensor x = torch::randn({rows, cols}) * 3, d = torch::randn({rows, cols});
      if (kind == 1) x[rows / 2][cols / 3] = NAN;
      if (kind == 2) x.zero_(), d.zero_();
      x = x.to(dev, dt), d = d.to(dev, dt);
      const torch::Tensor w = (torch::randn({cols}) * 0.5 + 1).to(dev, dt), b = (torch::randn({cols}) * 0.1).to(dev, dt);
      std::vector<torch::Tensor> in0 = {x.clone().requires_grad_(), d.clone().requires_grad_(), w.clone().requires_grad_(),
                                 b.clone().requires_grad_()};
      std::vector<torch::Tensor> in1 = {x.clone().requires_grad_(), d.clone().requires_grad_(), w.clone().requires_grad_(),
                                 b.clone().requires_grad_()};
      torch::Tensor s0, y0, s1, y1, a1;
      if (rms) {
        std::tie(s0, y0) = strobe::ops::add_rms_norm(in0[0], in0[1], in0[2], 1e-6);
        std::tie(s1, y1, a1) = strobe::ops::add_rms_norm_amax(in1[0], in1[1], in1[2], 1e-6);
      } else {
        std::tie(s0, y0) = strobe::ops::add_layer_norm(in0[0], in0[1], in0[2], in0[3], 1e-5);
        std::tie(s1, y1, a1) = strobe::ops::add_layer_norm_amax(in1[0], in1[1], in1[2], in1[3], 1e-5);
      }
      EXPECT_TRUE(same(s0, s1)) << w_ << ": sum";
      EXPECT_TRUE(same(y0, y1)) << w_ << ": y";
      ASSERT_TRUE(a1.dim() == 0 && a1.scalar_type() == torch::kFloat && a1.device() == x.device()) << w_;
      EXPECT_FALSE(a1.requires_grad()) << w_;
      const float want = y0.detach().to(torch::kFloat).abs().max().item<float>(), got = a1.item<float>();
      EXPECT_TRUE(got == want || (std::isnan(got) && std::isnan(want))) << w_ << ": amax " << got << ", max |y| " << want;
      if (kind == 2 && rms) EXPECT_EQ(got, 0.f) << w_;  // (LayerNorm of zeros is its bias)
      const torch::Tensor gy = torch::randn({rows, cols}).to(dev, dt), gs = torch::randn({rows, cols}).to(dev, dt);
      ((y0 * gy).sum() + (s0 * gs).sum()).backward();
      ((y1 * gy).sum() + (s1 * gs).sum()).backward();
      for (int i = 0; i < (rms ? 3 : 4); ++i) EXPECT_TRUE(same(in0[i].grad(), in1[i].grad())) << w_ << ": gradient " << i;
    }
  }
}

}  // namespace strobe::testing
