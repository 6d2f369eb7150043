// linear_cross_entropy on CUDA (the ATen chunks, d weight through cuBLAS's bf16 -> fp32 GEMM) against
// the unfused head on the same GPU and float64 autograd on the CPU, the allocator poisoned with NaN
// first. Bounds: fp32 loss 1e-5 and gradients 1e-4 (TF32 off: cuBLAS's fp32 GEMMs); bf16 loss 1e-3,
// gradients 1.5e-2 (bf16 logits and products, as the unfused head has them). A 2048-token batch over
// a 32,000-token vocabulary in chunks of 512 rows, ignored targets, a tied-style weight used twice.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "framework/ops/ops.h"
#include "tests/gpu_test_util.h"

namespace {

using torch::Tensor;

using strobe::testing::kCuda;
using strobe::testing::poison_allocator;
using strobe::testing::rel_err;

TEST(LinearCrossEntropyCuda, MatchesTheUnfusedHeadAndFloat64) {
  SKIP_WITHOUT_CUDA();
  for (auto dt : {torch::kBFloat16, torch::kFloat}) {
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

}  // namespace
