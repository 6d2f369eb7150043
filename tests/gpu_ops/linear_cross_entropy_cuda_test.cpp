// linear_cross_entropy on CUDA (one cross_entropy_rows kernel per chunk for the loss and softmax -
// onehot, d weight through cuBLAS's bf16 -> fp32 GEMM) against the unfused head on the same GPU and
// float64 autograd on the CPU, the allocator poisoned with NaN first. Bounds: fp32 loss 1e-5 and
// gradients 1e-4 (TF32 off: cuBLAS's fp32 GEMMs); bf16 / fp16 loss 1e-3, gradients 1.5e-2 (16-bit
// logits and products, as the unfused head has them). A 2048-token batch over a 32,000-token
// vocabulary in chunks of 512 rows with ignored targets; a 1,001-token vocabulary (not a multiple of
// 8: the kernel's scalar path) with a bias, automatic chunks and an incoming gradient of 0.37 (d weight
// and d bias: their fp32 accumulators scaled and rounded once, bit for bit); NaN,
// a target out of range, no target at all, and two runs bit for bit.
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

TEST(LinearCrossEntropyCuda, MatchesTheUnfusedHeadAndFloat64) {
  SKIP_WITHOUT_CUDA();
  for (auto dt : {torch::kBFloat16, torch::kHalf, torch::kFloat}) {
    SCOPED_TRACE(c10::toString(dt));
    poison_allocator();
    const auto o = torch::TensorOptions(kCuda).dtype(dt);
    const int64_t n = 2048, c = 256, v = 32000;
    const Tensor h = torch::randn({n, c}, o).requires_grad_();
    const Tensor w = (torch::randn({v, c}, o) * 0.05).requires_grad_();
    Tensor t = torch::randint(0, v, {n}, torch::TensorOptions(kCuda).dtype(torch::kLong));
    t.index_put_({torch::indexing::Slice(0, n, 7)}, -100);
    const Tensor loss = strobe::ops::linear_cross_entropy(h, w, std::nullopt, t, -100, 512);
    loss.backward();
    const Tensor h2 = h.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
    const Tensor ref = torch::nn::functional::cross_entropy(torch::linear(h2, w2).to(torch::kFloat), t,
                                                            torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
    ref.backward();
    const Tensor h64 = h.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor w64 = w.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor ref64 = torch::nn::functional::cross_entropy(torch::linear(h64, w64), t.cpu(),
                                                              torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
    ref64.backward();
    const bool lowp = dt != torch::kFloat;
    EXPECT_LT(rel_err(loss, ref64), lowp ? 1e-3 : 1e-5) << "loss";
    EXPECT_LT(rel_err(loss, ref.to(torch::kDouble)), lowp ? 1e-3 : 1e-5) << "loss vs unfused";
    EXPECT_LT(rel_err(h.grad(), h64.grad()), lowp ? 1.5e-2 : 1e-4) << "dhidden";
    EXPECT_LT(rel_err(w.grad(), w64.grad()), lowp ? 1.5e-2 : 1e-4) << "dweight";
    EXPECT_LE(rel_err(w.grad(), w64.grad()), rel_err(w2.grad(), w64.grad()) * 1.5 + 1e-6)
        << "dweight no further from float64 than the unfused head's";
    EXPECT_EQ(h.grad()[0].abs().max().item<float>(), 0.f) << "an ignored row";
  }
}

TEST(LinearCrossEntropyCuda, ScalarPathWithBiasAndWithoutGradient) {
  SKIP_WITHOUT_CUDA();
  for (auto dt : {torch::kBFloat16, torch::kFloat}) {
    SCOPED_TRACE(c10::toString(dt));
    poison_allocator();
    const auto o = torch::TensorOptions(kCuda).dtype(dt);
    const int64_t n = 300, c = 64, v = 1001;
    const Tensor h = torch::randn({n, c}, o).requires_grad_();
    const Tensor w = (torch::randn({v, c}, o) * 0.1).requires_grad_();
    const Tensor b = (torch::randn({v}, o) * 0.5).requires_grad_();
    Tensor t = torch::randint(0, v, {n}, torch::TensorOptions(kCuda).dtype(torch::kLong));
    t.index_put_({torch::indexing::Slice(3, n, 5)}, -1);
    const Tensor loss = strobe::ops::linear_cross_entropy(h, w, b, t, -1);
    (loss * 0.37).backward();  // an incoming gradient other than 1 (the backward's device-scalar kernel)
    const Tensor h64 = h.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor w64 = w.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor b64 = b.detach().to(torch::kCPU, torch::kDouble).requires_grad_();
    const Tensor ref64 = torch::nn::functional::cross_entropy(torch::linear(h64, w64, b64), t.cpu(),
                                                              torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
    (ref64 * 0.37).backward();
    const bool lowp = dt != torch::kFloat;
    EXPECT_LT(rel_err(loss, ref64), lowp ? 1e-3 : 1e-5) << "loss";
    EXPECT_LT(rel_err(h.grad(), h64.grad()), lowp ? 1.5e-2 : 1e-4) << "dhidden";
    EXPECT_LT(rel_err(w.grad(), w64.grad()), lowp ? 1.5e-2 : 1e-4) << "dweight";
    EXPECT_LT(rel_err(b.grad(), b64.grad()), lowp ? 1.5e-2 : 1e-4) << "dbias";
    EXPECT_EQ(w.grad().scalar_type(), dt);
    torch::NoGradGuard no_grad;
    {
      // d weight and d bias: the forward's fp32 accumulators times 0.37, rounded once (the backward's
      // kernel: 16-byte vectors, and the scalar tail of the bias's 1,001 elements).
      static const auto fwd = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("strobe::linear_cross_entropy_fwd", "")
                                  .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(
                                      const Tensor&, const Tensor&, const std::optional<Tensor>&, const Tensor&, int64_t,
                                      int64_t, bool)>();
      auto [l32, dh, dw32, db32] = fwd.call(h, w, b, t, -1, 0, true);
      ASSERT_EQ(dw32.scalar_type(), torch::kFloat);
      const Tensor s = torch::full({}, 0.37f, torch::TensorOptions(kCuda));
      EXPECT_TRUE(torch::equal(w.grad(), (dw32 * s).to(dt))) << "d weight: one rounding of the scaled fp32 value";
      EXPECT_TRUE(torch::equal(b.grad(), (db32 * s).to(dt))) << "d bias: one rounding of the scaled fp32 value";
    }
    EXPECT_TRUE(torch::equal(strobe::ops::linear_cross_entropy(h, w, b, t, -1), loss))
        << "the loss without a gradient is the training loss bit for bit";
  }
}

TEST(LinearCrossEntropyCuda, NonFiniteBadTargetsNoTargetsAndRepeatability) {
  SKIP_WITHOUT_CUDA();
  const auto o = torch::TensorOptions(kCuda).dtype(torch::kBFloat16);
  const auto lo = torch::TensorOptions(kCuda).dtype(torch::kLong);
  const int64_t n = 700, c = 128, v = 4096;
  const Tensor h0 = torch::randn({n, c}, o), w0 = torch::randn({v, c}, o) * 0.05;
  const Tensor t = torch::randint(0, v, {n}, lo);
  auto run = [&](const Tensor& hin, const Tensor& tin) {
    poison_allocator();
    const Tensor h = hin.clone().requires_grad_(), w = w0.clone().requires_grad_();
    const Tensor loss = strobe::ops::linear_cross_entropy(h, w, std::nullopt, tin, -100, 256);
    loss.backward();
    return std::make_tuple(loss, h.grad(), w.grad());
  };
  const auto [l1, dh1, dw1] = run(h0, t);
  const auto [l2, dh2, dw2] = run(h0, t);
  EXPECT_TRUE(std::isfinite(l1.item<float>()));
  EXPECT_TRUE(torch::equal(l1, l2) && torch::equal(dh1, dh2) && torch::equal(dw1, dw2)) << "two runs, bit for bit";
  // A NaN in one hidden state (in the second chunk) reaches the loss and every d weight row.
  Tensor hn = h0.clone();
  hn[300][5] = NAN;
  const auto [ln, dhn, dwn] = run(hn, t);
  EXPECT_TRUE(std::isnan(ln.item<float>())) << "a NaN hidden state gives a NaN loss";
  EXPECT_TRUE(torch::isnan(dhn[300]).all().item<bool>()) << "and a NaN d hidden row";
  EXPECT_TRUE(torch::isnan(dwn).any(1).all().item<bool>()) << "and NaN in every d weight row";
  EXPECT_TRUE(torch::isfinite(dhn[0]).all().item<bool>()) << "other rows' d hidden stay finite";
  // A target outside [0, V) that is not ignore_index: NaN, never a silent pass.
  Tensor tb = t.clone();
  tb[10] = v + 3;
  const auto [lb, dhb, dwb] = run(h0, tb);
  EXPECT_TRUE(std::isnan(lb.item<float>())) << "a target out of range gives a NaN loss";
  EXPECT_TRUE(torch::isnan(dhb[10]).all().item<bool>()) << "and a NaN gradient";
  // No target at all: the mean of nothing is NaN, as PyTorch; the gradients are 0, as PyTorch's.
  const auto [l0, dh0, dw0] = run(h0, torch::full({n}, -100, lo));
  EXPECT_TRUE(std::isnan(l0.item<float>()));
  EXPECT_EQ(dh0.abs().max().item<float>(), 0.f);
  EXPECT_EQ(dw0.abs().max().item<float>(), 0.f);
}

}  // namespace
