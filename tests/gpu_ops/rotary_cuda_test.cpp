// rotary_qk's CUDA kernel against transformers' ATen ops on the same GPU (bit for bit, forward and
// autograd backward: the kernel rounds where ATen rounds) and against a float64 rotation on the CPU
// (fp32 1e-6, bf16 / fp16 8e-3: the roundings of the tables, the two products and their sum), with
// the caching allocator poisoned with NaN first so an unwritten output element fails. Llama's shapes
// (32 query heads over 8 K/V heads, head_dim 64) padded and packed, head_dim 128, an unaligned
// head_dim (the scalar path), fp32 / bf16 / fp16, and tables whose halves differ.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/gpu_test_util.h"

namespace {

using torch::Tensor;

using strobe::testing::kCuda;
using strobe::testing::poison_allocator;
using strobe::testing::rel_err;

Tensor hf_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const auto c = cos.unsqueeze(-2).to(x.scalar_type()), s = sin.unsqueeze(-2).to(x.scalar_type());
  const int64_t h = x.size(-1) / 2;
  return x * c + torch::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1) * s;
}

struct RotCase {
  std::vector<int64_t> lead;
  int64_t hq, hk, d;
  torch::ScalarType dtype;
  bool hf_tables = true;  // false: independent random cos / sin for each half (the op's general rule)
};
void PrintTo(const RotCase& c, std::ostream* os) {
  for (auto l : c.lead) *os << l << "x";
  *os << c.hq << "_" << c.hk << "_" << c.d << "_" << c10::toString(c.dtype);
}
class RotaryCuda : public ::testing::TestWithParam<RotCase> {};

TEST_P(RotaryCuda, IsHuggingFacesRotaryBitForBitAndMatchesFloat64) {
  SKIP_WITHOUT_CUDA();
  const RotCase c = GetParam();
  auto with = [&](std::vector<int64_t> tail) {
    auto s = c.lead;
    s.insert(s.end(), tail.begin(), tail.end());
    return s;
  };
  for (int rep = 0; rep < 2; ++rep) {
    poison_allocator();
    const auto o = torch::TensorOptions(kCuda).dtype(c.dtype);
    const Tensor q = torch::randn(with({c.hq, c.d}), o).requires_grad_(), k = torch::randn(with({c.hk, c.d}), o).requires_grad_();
    // Angles as llama's tables make them: positions (restarting per packed document) x frequencies.
    const Tensor pos = torch::randint(0, 2048, with({}), torch::TensorOptions(kCuda).dtype(torch::kLong)).to(torch::kFloat);
    const Tensor inv = torch::pow(500000.0, -torch::arange(0, c.d, 2, torch::TensorOptions(kCuda)).to(torch::kFloat) / c.d);
    const Tensor f = pos.unsqueeze(-1) * inv;
    const Tensor emb = torch::cat({f, f}, -1);
    const Tensor cos = c.hf_tables ? emb.cos() : torch::rand(emb.sizes(), emb.options()) * 2 - 1;
    const Tensor sin = c.hf_tables ? emb.sin() : torch::rand(emb.sizes(), emb.options()) * 2 - 1;
    auto [qo, ko] = strobe::ops::rotary_qk(q, k, cos, sin);
    ASSERT_EQ(qo.scalar_type(), c.dtype);
    const Tensor q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_();
    const Tensor qr = hf_rotary(q2, cos, sin), kr = hf_rotary(k2, cos, sin);
    EXPECT_TRUE(torch::equal(qo, qr)) << "q: " << rel_err(qo, qr.to(torch::kDouble));
    EXPECT_TRUE(torch::equal(ko, kr)) << "k: " << rel_err(ko, kr.to(torch::kDouble));
    const Tensor gq = torch::randn(qo.sizes(), o), gk = torch::randn(ko.sizes(), o);
    torch::autograd::backward({qo, ko}, {gq, gk});
    torch::autograd::backward({qr, kr}, {gq, gk});
    EXPECT_TRUE(torch::equal(q.grad(), q2.grad())) << "dq: " << rel_err(q.grad(), q2.grad().to(torch::kDouble));
    EXPECT_TRUE(torch::equal(k.grad(), k2.grad())) << "dk";
    // float64 on the CPU.
    const Tensor q64 = q.detach().to(torch::kCPU, torch::kDouble), g64 = gq.to(torch::kCPU, torch::kDouble);
    const Tensor c64 = cos.to(torch::kCPU, torch::kDouble).unsqueeze(-2), s64 = sin.to(torch::kCPU, torch::kDouble).unsqueeze(-2);
    const int64_t h = c.d / 2;
    auto rot = [&](const Tensor& x) { return torch::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1); };
    auto rot_t = [&](const Tensor& x) { return torch::cat({x.narrow(-1, h, h), -x.narrow(-1, 0, h)}, -1); };
    const double bound = c.dtype == torch::kFloat ? 1e-6 : 8e-3;
    EXPECT_LT(rel_err(qo, q64 * c64 + rot(q64) * s64), bound) << "q vs float64";
    EXPECT_LT(rel_err(q.grad(), g64 * c64 + rot_t(g64 * s64)), bound) << "dq vs float64";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RotaryCuda,
                         ::testing::Values(RotCase{{8, 2048}, 32, 8, 64, torch::kBFloat16},
                                           RotCase{{16384}, 32, 8, 64, torch::kBFloat16},
                                           RotCase{{3, 77}, 8, 2, 128, torch::kFloat},
                                           RotCase{{5, 9}, 4, 4, 64, torch::kHalf, false},
                                           RotCase{{37}, 6, 3, 12, torch::kBFloat16},
                                           RotCase{{1}, 1, 1, 2, torch::kFloat}));

TEST(RotaryCudaNan, NanStaysInItsPairAndBadInputsAreErrors) {
  SKIP_WITHOUT_CUDA();
  const auto o = torch::TensorOptions(kCuda).dtype(torch::kBFloat16);
  Tensor q = torch::randn({4, 8, 64}, o);
  q[1][2][5] = NAN;
  const Tensor ang = torch::rand({4, 64}, torch::TensorOptions(kCuda));
  const auto [qo, ko] = strobe::ops::rotary_qk(q, torch::randn({4, 2, 64}, o), ang.cos(), ang.sin());
  const Tensor qc = qo.cpu();
  EXPECT_TRUE(torch::isnan(qc[1][2][5]).item<bool>());
  EXPECT_TRUE(torch::isnan(qc[1][2][37]).item<bool>()) << "its pair";
  EXPECT_EQ(torch::isnan(qc).sum().item<int64_t>(), 2);
  EXPECT_THROW(strobe::ops::rotary_qk(torch::randn({4, 8, 1024}, o), torch::randn({4, 2, 1024}, o), torch::rand({4, 1024}, o),
                                      torch::rand({4, 1024}, o)),
               c10::Error);  // head_dim above the kernel's 512
  EXPECT_THROW(strobe::ops::rotary_qk(q.to(torch::kDouble), torch::randn({4, 2, 64}, o).to(torch::kDouble), ang.cos(), ang.sin()),
               c10::Error);
}

}  // namespace
