// strobe::flash_attention on CPU: the reference (the op's CPU kernel) against a naive per-sequence
// softmax in double, its closed-form backward against autograd through the reference, varlen
// against each sequence alone, empty rows, argument errors and the Meta (fake) kernels.
#include <cmath>
#include <limits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/ops/ops.h"
#include "tests/ops/op_test_util.h"

namespace {

using torch::Tensor;
using strobe::ops::flash_attention;
using strobe::ops::flash_attention_reference;
using strobe::ops::flash_attention_varlen;

const auto kF64 = torch::TensorOptions().dtype(torch::kDouble);

// softmax(scale q k^T) v for one sequence [S, H, D], causal bottom-right aligned, in double.
std::pair<Tensor, Tensor> naive(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  const int64_t sq = q.size(0), sk = k.size(0);
  Tensor s = torch::einsum("qhd,khd->hqk", {q, k}) * scale;
  if (causal) {
    auto allowed = torch::ones({sq, sk}, torch::kBool).tril(sk - sq);
    s = s.masked_fill(allowed.logical_not(), -INFINITY);
  }
  // Shift by the row max (0 for rows with no key) so autograd sees no inf - inf.
  Tensor m = std::get<0>(s.max(-1, true)).detach();
  m = torch::where(torch::isinf(m), torch::zeros_like(m), m);
  Tensor e = torch::exp(s - m), l = e.sum(-1, true);
  Tensor l1 = torch::where(l == 0, torch::ones_like(l), l);
  Tensor lse = torch::where(l == 0, torch::full_like(l, INFINITY), m + torch::log(l1)).squeeze(-1);  // [H, Sq]
  return {torch::einsum("hqk,khd->qhd", {e / l1, v}), lse};
}

TEST(FlashAttentionCpu, MatchesNaiveSoftmaxFixedLength) {
  torch::manual_seed(0);
  for (bool causal : {false, true}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{5, 5}, {3, 8}, {9, 4}}) {
      Tensor q = torch::randn({2, sq, 3, 8}, kF64), k = torch::randn({2, sk, 3, 8}, kF64), v = torch::randn({2, sk, 3, 8}, kF64);
      auto [out, lse] = flash_attention(q, k, v, causal, 0.4);
      ASSERT_EQ(lse.sizes(), (torch::IntArrayRef{2, 3, sq}));
      for (int64_t b = 0; b < 2; ++b) {
        auto [o_ref, l_ref] = naive(q[b], k[b], v[b], causal, 0.4);
        EXPECT_TRUE(torch::allclose(out[b], o_ref, 1e-10, 1e-12)) << "causal " << causal << " sq " << sq << " sk " << sk;
        EXPECT_TRUE(torch::allclose(lse[b], l_ref, 1e-10, 1e-12, /*equal_nan=*/false));
      }
    }
  }
}

TEST(FlashAttentionCpu, RowsThatSeeNoKeyGiveZerosAndInfiniteLse) {
  // Causal with Sq > Sk: row r sees keys c <= r - 4, so rows 0..3 see nothing.
  Tensor q = torch::randn({1, 6, 2, 4}, kF64).requires_grad_(), k = torch::randn({1, 2, 2, 4}, kF64).requires_grad_(),
         v = torch::randn({1, 2, 2, 4}, kF64).requires_grad_();
  auto [out, lse] = flash_attention(q, k, v, /*causal=*/true);
  EXPECT_TRUE(torch::equal(out.narrow(1, 0, 4), torch::zeros({1, 4, 2, 4}, kF64)));
  EXPECT_TRUE(torch::isinf(lse.narrow(2, 0, 4)).all().item<bool>());
  EXPECT_TRUE((lse.narrow(2, 0, 4) > 0).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(lse.narrow(2, 4, 2)).all().item<bool>());
  out.sum().backward();
  EXPECT_TRUE(torch::isfinite(q.grad()).all().item<bool>());
  EXPECT_TRUE(torch::equal(q.grad().narrow(1, 0, 4), torch::zeros({1, 4, 2, 4}, kF64)));
  // The reference differentiated by autograd gives no NaN either.
  Tensor q2 = q.detach().clone().requires_grad_();
  std::get<0>(flash_attention_reference(q2, k.detach(), v.detach(), std::nullopt, std::nullopt, 0, 0, true)).sum().backward();
  EXPECT_TRUE(torch::isfinite(q2.grad()).all().item<bool>());
}

TEST(FlashAttentionCpu, ClosedFormBackwardMatchesAutogradOfTheReference) {
  torch::manual_seed(1);
  for (bool causal : {false, true}) {
    Tensor q = torch::randn({2, 7, 2, 8}, kF64), k = torch::randn({2, 9, 2, 8}, kF64), v = torch::randn({2, 9, 2, 8}, kF64);
    Tensor dout = torch::randn({2, 7, 2, 8}, kF64);
    auto leaves = [&] {
      return std::vector<Tensor>{q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()};
    };
    auto a = leaves(), b = leaves();
    auto ga = torch::autograd::grad({std::get<0>(flash_attention(a[0], a[1], a[2], causal))}, a, {dout});
    auto gb = torch::autograd::grad(
        {std::get<0>(flash_attention_reference(b[0], b[1], b[2], std::nullopt, std::nullopt, 0, 0, causal))}, b, {dout});
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::allclose(ga[i], gb[i], 1e-10, 1e-12)) << i << " causal " << causal;
  }
}

TEST(FlashAttentionCpu, VarlenEqualsEachSequenceAloneWithGradients) {
  torch::manual_seed(2);
  const std::vector<int> lq = {3, 1, 0, 6}, lk = {5, 1, 2, 4};
  const int tq = 10, tk = 12;
  for (bool causal : {false, true}) {
    Tensor q = torch::randn({tq + 2, 2, 4}, kF64).requires_grad_(), k = torch::randn({tk, 2, 4}, kF64).requires_grad_(),
           v = torch::randn({tk, 2, 4}, kF64).requires_grad_();
    Tensor cq = torch::tensor({0, 3, 4, 4, 10}, torch::kInt32), ck = torch::tensor({0, 5, 6, 8, 12}, torch::kInt32);
    auto [out, lse] = flash_attention_varlen(q, k, v, cq, ck, 6, 5, causal);
    ASSERT_EQ(lse.sizes(), (torch::IntArrayRef{2, tq + 2}));
    Tensor dout = torch::randn(out.sizes(), kF64);
    auto g = torch::autograd::grad({out}, {q, k, v}, {dout});
    int sq0 = 0, sk0 = 0;
    for (size_t i = 0; i < lq.size(); ++i) {
      if (lq[i] > 0) {
        Tensor qi = q.detach().narrow(0, sq0, lq[i]).clone().requires_grad_(), ki = k.detach().narrow(0, sk0, lk[i]).clone().requires_grad_(),
               vi = v.detach().narrow(0, sk0, lk[i]).clone().requires_grad_();
        auto [o_ref, l_ref] = naive(qi, ki, vi, causal, 0.5);
        EXPECT_TRUE(torch::allclose(out.narrow(0, sq0, lq[i]), o_ref, 1e-10, 1e-12)) << "seq " << i;
        EXPECT_TRUE(torch::allclose(lse.narrow(1, sq0, lq[i]), l_ref, 1e-10, 1e-12)) << "seq " << i;
        auto gi = torch::autograd::grad({o_ref}, {qi, ki, vi}, {dout.narrow(0, sq0, lq[i])});
        EXPECT_TRUE(torch::allclose(g[0].narrow(0, sq0, lq[i]), gi[0], 1e-10, 1e-12)) << "dq seq " << i;
        EXPECT_TRUE(torch::allclose(g[1].narrow(0, sk0, lk[i]), gi[1], 1e-10, 1e-12)) << "dk seq " << i;
        EXPECT_TRUE(torch::allclose(g[2].narrow(0, sk0, lk[i]), gi[2], 1e-10, 1e-12)) << "dv seq " << i;
      } else {
        EXPECT_TRUE(torch::equal(g[1].narrow(0, sk0, lk[i]), torch::zeros({lk[i], 2, 4}, kF64)));  // keys nobody sees
      }
      sq0 += lq[i];
      sk0 += lk[i];
    }
    // The two packed rows past cu_seqlens_q[-1]: zero output, +inf LSE, zero gradient.
    EXPECT_TRUE(torch::equal(out.narrow(0, tq, 2), torch::zeros({2, 2, 4}, kF64)));
    EXPECT_TRUE(torch::isinf(lse.narrow(1, tq, 2)).all().item<bool>());
    EXPECT_TRUE(torch::equal(g[0].narrow(0, tq, 2), torch::zeros({2, 2, 4}, kF64)));
  }
}

TEST(FlashAttentionCpu, HalfInputsComputeInFloat) {
  torch::manual_seed(3);
  Tensor q = torch::randn({1, 20, 2, 16}), k = torch::randn({1, 20, 2, 16}), v = torch::randn({1, 20, 2, 16});
  auto [o16, l16] = flash_attention(q.to(torch::kBFloat16), k.to(torch::kBFloat16), v.to(torch::kBFloat16), true);
  EXPECT_EQ(o16.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(l16.scalar_type(), torch::kFloat);
  auto [o64, l64] = flash_attention(q.to(torch::kBFloat16).to(torch::kDouble), k.to(torch::kBFloat16).to(torch::kDouble),
                                    v.to(torch::kBFloat16).to(torch::kDouble), true);
  EXPECT_LT((o16.to(torch::kDouble) - o64).norm().item<double>() / o64.norm().item<double>(), 5e-3);
}

using strobe::testing::expect_error;

TEST(FlashAttentionCpu, BadArgumentsAreClearErrors) {
  Tensor x = torch::randn({1, 4, 2, 8}), p = torch::randn({6, 2, 8});
  expect_error([&] { flash_attention(x, x, x.to(torch::kDouble)); }, "must have one dtype");
  expect_error([&] { flash_attention(p, p, p); }, "must be [B, S, H, D]");
  expect_error([&] { flash_attention(x, torch::randn({1, 4, 3, 8}), torch::randn({1, 4, 3, 8})); }, "same number of heads");
  expect_error([&] { flash_attention(x, x, torch::randn({1, 4, 2, 4})); }, "same head_dim");
  expect_error([&] { flash_attention(x, x, x, false, -1.0); }, "softmax_scale must be a positive");
  const Tensor cu = torch::tensor({0, 2, 6}, torch::kInt32);
  expect_error([&] { flash_attention_varlen(p, p, p, cu.to(torch::kLong), cu, 4, 4); }, "cu_seqlens must be int32");
  expect_error([&] { flash_attention_varlen(p, p, p, cu, cu, 3, 4); }, "more than max_seqlen_q");
  expect_error([&] { flash_attention_varlen(p, p, p, torch::tensor({0, 4, 2}, torch::kInt32), cu, 4, 4); },
               "non-decreasing");
  expect_error([&] { flash_attention_varlen(p, p, p, torch::tensor({0, 2, 7}, torch::kInt32), cu, 5, 4); }, "exceeds");
  expect_error([&] { flash_attention_varlen(x, x, x, cu, cu, 4, 4); }, "must be packed [T, H, D]");
}

TEST(FlashAttentionCpu, MetaKernelsGiveShapesWithoutData) {
  const auto meta = torch::TensorOptions().device(torch::kMeta).dtype(torch::kBFloat16);
  auto [out, lse] = flash_attention(torch::empty({2, 9, 3, 64}, meta), torch::empty({2, 5, 3, 64}, meta),
                                    torch::empty({2, 5, 3, 64}, meta), true);
  EXPECT_EQ(out.sizes(), (torch::IntArrayRef{2, 9, 3, 64}));
  EXPECT_EQ(lse.sizes(), (torch::IntArrayRef{2, 3, 9}));
  EXPECT_EQ(lse.scalar_type(), torch::kFloat);
  EXPECT_TRUE(out.is_meta());
  const Tensor cu = torch::empty({4}, torch::TensorOptions().device(torch::kMeta).dtype(torch::kInt32));
  auto [vo, vl] = flash_attention_varlen(torch::empty({40, 3, 128}, meta), torch::empty({50, 3, 128}, meta),
                                         torch::empty({50, 3, 128}, meta), cu, cu, 20, 30);
  EXPECT_EQ(vo.sizes(), (torch::IntArrayRef{40, 3, 128}));
  EXPECT_EQ(vl.sizes(), (torch::IntArrayRef{3, 40}));
}

}  // namespace
