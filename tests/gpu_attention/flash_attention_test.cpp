// strobe::flash_attention's CUDA kernels against a float64 reference (the op library's reference
// in ATen ops, run in fp64 on the GPU, gradients by autograd through it). Fresh random inputs per
// case; the caching allocator is poisoned with NaN before every launch, so an output element a
// kernel forgets to write shows up as NaN, and NaN never passes (rel_err turns it into +inf).
// Bounds (relative Frobenius error vs fp64, bf16 and fp16 alike): out 1e-2, lse 1e-3 (finite rows;
// +inf rows must match exactly), dq/dk/dv 1e-2. Measured errors are printed per case.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#ifdef STROBE_TORCH_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include "strobe/ops/ops.h"

namespace {

using torch::Tensor;

#define SKIP_WITHOUT_CUDA()                                                                  \
  do {                                                                                       \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";              \
    if (!strobe::ops::built_with_cuda()) GTEST_SKIP() << "strobe_ops built without CUDA";    \
  } while (0)

const torch::Device kCuda("cuda");
constexpr double kOutBound = 1e-2, kLseBound = 1e-3, kGradBound = 1e-2;

void poison_allocator() {
  Tensor junk = torch::full({256 << 20}, NAN, torch::TensorOptions(kCuda).dtype(torch::kFloat));
  junk.reset();
}

double rel_err(const Tensor& got, const Tensor& want) {
  const Tensor w = want.to(torch::kDouble), g = got.to(want.device(), torch::kDouble);
  const double num = (g - w).norm().item<double>();
  if (std::isnan(num)) return INFINITY;
  const double den = w.norm().item<double>();
  return den == 0 ? num : num / den;
}

// LSE: the +inf pattern must match exactly, the finite entries by relative error.
double lse_err(const Tensor& got, const Tensor& want) {
  const Tensor g = got.to(torch::kDouble), w = want.to(torch::kDouble);
  if (torch::isnan(g).any().item<bool>()) return INFINITY;
  const Tensor inf_w = torch::isinf(w), inf_g = torch::isinf(g);
  if (!torch::equal(inf_w, inf_g)) return INFINITY;
  const Tensor fin = inf_w.logical_not();
  if (!fin.any().item<bool>()) return 0.0;
  return rel_err(g.masked_select(fin), w.masked_select(fin));
}

struct Case {
  std::string name;
  Tensor q, k, v;  // kernel dtype on CUDA
  std::optional<Tensor> cu_q, cu_k;
  int64_t max_q = 0, max_k = 0;
  bool causal = false;
  std::optional<double> scale;
};

struct Result {
  Tensor out, lse, dq, dk, dv;
};

Result run_op(const Case& c, const Tensor& dout, bool deterministic = false) {
  // detach() keeps the strides, so views of a fused projection reach the kernels as views.
  Tensor q = c.q.detach().requires_grad_(true), k = c.k.detach().requires_grad_(true),
         v = c.v.detach().requires_grad_(true);
  poison_allocator();
  Tensor out, lse;
  if (c.cu_q) {
    std::tie(out, lse) = strobe::ops::flash_attention_varlen(q, k, v, *c.cu_q, *c.cu_k, c.max_q, c.max_k, c.causal,
                                                             c.scale, deterministic);
  } else {
    std::tie(out, lse) = strobe::ops::flash_attention(q, k, v, c.causal, c.scale, deterministic);
  }
  poison_allocator();
  auto g = torch::autograd::grad({out}, {q, k, v}, {dout});
  return {out.detach(), lse, g[0], g[1], g[2]};
}

Result run_ref(const Case& c, const Tensor& dout) {
  auto d = [](const Tensor& x) { return x.detach().to(torch::kDouble).requires_grad_(true); };
  Tensor q = d(c.q), k = d(c.k), v = d(c.v);
  auto [out, lse] = strobe::ops::flash_attention_reference(q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal, c.scale);
  auto g = torch::autograd::grad({out}, {q, k, v}, {dout.to(torch::kDouble)});
  return {out.detach(), lse.detach(), g[0], g[1], g[2]};
}

void check_case(const Case& c) {
  SCOPED_TRACE(c.name);
  const Tensor dout = torch::randn(c.q.sizes(), c.q.options());
  const Result got = run_op(c, dout);
  const Result want = run_ref(c, dout);
  ASSERT_EQ(got.out.sizes(), want.out.sizes());
  ASSERT_EQ(got.lse.sizes(), want.lse.sizes());
  const double e_out = rel_err(got.out, want.out), e_lse = lse_err(got.lse, want.lse);
  const double e_dq = rel_err(got.dq, want.dq), e_dk = rel_err(got.dk, want.dk), e_dv = rel_err(got.dv, want.dv);
  std::printf("[flash] %-48s out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", c.name.c_str(), e_out, e_lse, e_dq, e_dk,
              e_dv);
  EXPECT_LT(e_out, kOutBound);
  EXPECT_LT(e_lse, kLseBound);
  EXPECT_LT(e_dq, kGradBound);
  EXPECT_LT(e_dk, kGradBound);
  EXPECT_LT(e_dv, kGradBound);
}

torch::TensorOptions opts(torch::Dtype dt) { return torch::TensorOptions(kCuda).dtype(dt); }

Case fixed(int64_t b, int64_t sq, int64_t sk, int64_t h, int64_t d, bool causal, torch::Dtype dt = torch::kBFloat16) {
  Case c;
  c.name = "B" + std::to_string(b) + " Sq" + std::to_string(sq) + " Sk" + std::to_string(sk) + " H" +
           std::to_string(h) + " D" + std::to_string(d) + (causal ? " causal" : "") +
           (dt == torch::kHalf ? " fp16" : " bf16");
  c.q = torch::randn({b, sq, h, d}, opts(dt));
  c.k = torch::randn({b, sk, h, d}, opts(dt));
  c.v = torch::randn({b, sk, h, d}, opts(dt));
  c.causal = causal;
  return c;
}

Tensor cu_of(const std::vector<int>& lengths) {
  std::vector<int> cu{0};
  for (int n : lengths) cu.push_back(cu.back() + n);
  return torch::tensor(cu, torch::TensorOptions().dtype(torch::kInt32)).to(kCuda);
}

Case varlen(const std::vector<int>& lq, const std::vector<int>& lk, int64_t h, int64_t d, bool causal,
            int64_t extra_rows = 0) {
  Case c;
  int tq = 0, tk = 0, mq = 0, mk = 0;
  for (int n : lq) tq += n, mq = std::max(mq, n);
  for (int n : lk) tk += n, mk = std::max(mk, n);
  c.name = "varlen n" + std::to_string(lq.size()) + " Tq" + std::to_string(tq) + " Tk" + std::to_string(tk) +
           " maxq" + std::to_string(mq) + " H" + std::to_string(h) + " D" + std::to_string(d) + (causal ? " causal" : "");
  c.q = torch::randn({tq + extra_rows, h, d}, opts(torch::kBFloat16));
  c.k = torch::randn({tk + extra_rows, h, d}, opts(torch::kBFloat16));
  c.v = torch::randn({tk + extra_rows, h, d}, opts(torch::kBFloat16));
  c.cu_q = cu_of(lq);
  c.cu_k = cu_of(lk);
  c.max_q = mq;
  c.max_k = mk;
  c.causal = causal;
  return c;
}

TEST(GpuFlashAttention, FixedLengthShapes) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(0);
  for (bool causal : {false, true}) {
    check_case(fixed(2, 1, 1, 3, 64, causal));
    check_case(fixed(2, 17, 17, 4, 128, causal));
    check_case(fixed(4, 196, 196, 16, 64, causal));
    check_case(fixed(1, 1024, 1024, 2, 128, causal));
    check_case(fixed(1, 3136, 3136, 2, 64, causal));
  }
  check_case(fixed(3, 196, 196, 16, 128, false, torch::kHalf));
  check_case(fixed(2, 333, 333, 3, 64, true, torch::kHalf));
}

TEST(GpuFlashAttention, LargeBatchTimesHeads) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(1);
  check_case(fixed(128, 64, 64, 16, 64, false));  // B*H = 2048
  check_case(fixed(64, 100, 100, 16, 128, true));  // B*H = 1024
}

TEST(GpuFlashAttention, UnequalQueryAndKeyLengthsAndFullyMaskedRows) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(2);
  for (bool causal : {false, true}) {
    check_case(fixed(2, 113, 203, 3, 64, causal));
    check_case(fixed(2, 203, 113, 3, 128, causal));  // causal: the first 90 rows see no key
    check_case(fixed(1, 239, 1, 2, 64, causal));
    check_case(fixed(1, 799, 3, 2, 128, causal));
    check_case(fixed(1, 1, 1023, 2, 64, causal));
  }
  // Rows that see no key: exactly zero output and +inf LSE, zero gradients, no NaN.
  Case c = fixed(1, 130, 60, 2, 64, true);
  const Tensor dout = torch::randn(c.q.sizes(), c.q.options());
  const Result r = run_op(c, dout);
  const Tensor empty_rows = r.out.narrow(1, 0, 70);
  EXPECT_TRUE(torch::equal(empty_rows, torch::zeros_like(empty_rows)));
  EXPECT_TRUE(torch::isinf(r.lse.narrow(2, 0, 70)).all().item<bool>());
  EXPECT_TRUE(torch::equal(r.dq.narrow(1, 0, 70), torch::zeros_like(r.dq.narrow(1, 0, 70))));
  EXPECT_TRUE(torch::isfinite(r.dk).all().item<bool>());
}

TEST(GpuFlashAttention, Varlen) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(3);
  for (bool causal : {false, true}) {
    check_case(varlen({1, 1024, 0, 17, 300, 64}, {1, 1024, 0, 17, 300, 64}, 4, 64, causal));
    check_case(varlen({5, 1, 100, 77}, {7, 0, 50, 200}, 3, 128, causal));  // cross lengths, empty k
    check_case(varlen({1, 1, 1}, {1, 1, 1}, 2, 64, causal));
  }
  // Rows past cu_seqlens_q[-1] belong to no sequence: zero output and gradients, +inf LSE.
  Case c = varlen({30, 70}, {30, 70}, 2, 64, true, /*extra_rows=*/9);
  check_case(c);
  const Tensor dout = torch::randn(c.q.sizes(), c.q.options());
  const Result r = run_op(c, dout);
  EXPECT_TRUE(torch::equal(r.out.narrow(0, 100, 9), torch::zeros_like(r.out.narrow(0, 100, 9))));
  EXPECT_TRUE(torch::equal(r.dk.narrow(0, 100, 9), torch::zeros_like(r.dk.narrow(0, 100, 9))));
}

TEST(GpuFlashAttention, StridedViewsOfAFusedProjectionAndSoftmaxScale) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(4);
  const Tensor qkv = torch::randn({3, 150, 3, 8, 64}, opts(torch::kBFloat16));
  Case c;
  c.name = "qkv views B3 S150 H8 D64 scale 0.3";
  c.q = qkv.select(2, 0);
  c.k = qkv.select(2, 1);
  c.v = qkv.select(2, 2);
  c.scale = 0.3;
  ASSERT_FALSE(c.q.is_contiguous());
  check_case(c);
  const Tensor packed = torch::randn({500, 3, 4, 128}, opts(torch::kBFloat16));
  Case p = varlen({100, 250, 150}, {100, 250, 150}, 4, 128, true);
  p.name = "varlen qkv views D128";
  p.q = packed.select(1, 0);
  p.k = packed.select(1, 1);
  p.v = packed.select(1, 2);
  check_case(p);
}

TEST(GpuFlashAttention, ForwardAndBackwardAreBitwiseReproducible) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(5);
  for (const Case& c : {fixed(2, 1000, 1000, 4, 64, true), varlen({300, 1, 700}, {300, 1, 700}, 4, 128, false)}) {
    const Tensor dout = torch::randn(c.q.sizes(), c.q.options());
    const Result a = run_op(c, dout, /*deterministic=*/true), b = run_op(c, dout, true), d = run_op(c, dout, false);
    EXPECT_TRUE(torch::equal(a.out, b.out)) << c.name;
    EXPECT_TRUE(torch::equal(a.lse, b.lse)) << c.name;
    for (const Result* r : {&b, &d}) {
      EXPECT_TRUE(torch::equal(a.dq, r->dq)) << c.name;
      EXPECT_TRUE(torch::equal(a.dk, r->dk)) << c.name;
      EXPECT_TRUE(torch::equal(a.dv, r->dv)) << c.name;
    }
  }
}

// On compute capability 9.0 both directions run the wgmma kernels (v4), elsewhere the mma.sync ones
// (forward v3, backward v1); ctest runs this binary a second time with STROBE_FLASH_ATTN=mma
// (gpu_attention_mma), so on an H100/H200 every case above checks both kernel families. A dispatch
// that silently fell back would fail here.
TEST(GpuFlashAttention, KernelFamilyMatchesTheDevice) {
  SKIP_WITHOUT_CUDA();
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const char* env = std::getenv("STROBE_FLASH_ATTN");
  const bool forced_mma = env != nullptr && std::string(env) == "mma";
  const bool want = !forced_mma && props->major == 9 && props->minor == 0;
  EXPECT_EQ(strobe::ops::flash_attention_uses_wgmma(), want)
      << props->name << " (compute capability " << props->major << "." << props->minor
      << "), STROBE_FLASH_ATTN=" << (env ? env : "(unset)");
  std::printf("flash attention kernels: %s on %s\n",
              strobe::ops::flash_attention_uses_wgmma() ? "wgmma (v4)" : "mma.sync (fwd v3, bwd v1)", props->name);
#endif
}

TEST(GpuFlashAttention, NaNInputsPropagate) {
  SKIP_WITHOUT_CUDA();
  Case c = fixed(1, 64, 64, 1, 64, false);
  c.q.index_put_({0, 5, 0, 3}, NAN);
  const Tensor dout = torch::randn(c.q.sizes(), c.q.options());
  const Result r = run_op(c, dout);
  EXPECT_TRUE(torch::isnan(r.out.select(1, 5)).any().item<bool>());
  EXPECT_TRUE(torch::isnan(r.dk).any().item<bool>());
}

TEST(GpuFlashAttention, UnsupportedInputsAreClearErrors) {
  SKIP_WITHOUT_CUDA();
  auto expect_error = [](const Tensor& q, const std::string& text) {
    try {
      strobe::ops::flash_attention(q, q, q);
      ADD_FAILURE() << "expected an error containing '" << text << "'";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error(torch::randn({1, 8, 2, 64}, opts(torch::kFloat)), "must be bfloat16 or float16");
  expect_error(torch::randn({1, 8, 2, 80}, opts(torch::kBFloat16)), "head_dim must be 64 or 128, got 80");
  expect_error(torch::randn({1, 8, 2, 64}, opts(torch::kDouble)), "must be bfloat16 or float16");
  try {
    strobe::ops::flash_attention(torch::randn({300, 1, 64}, opts(torch::kBFloat16)), torch::randn({300, 1, 64}, opts(torch::kBFloat16)),
                                 torch::randn({300, 1, 64}, opts(torch::kBFloat16)));
    ADD_FAILURE() << "expected an error for a 3-d input without cu_seqlens";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be [B, S, H, D]"), std::string::npos) << e.what();
  }
}

}  // namespace

namespace {

// Small shapes covering every kernel path (partial blocks, causal with empty rows, varlen with an
// empty sequence, both head dims, fp16), no reference: the target of the compute-sanitizer run
//   compute-sanitizer --tool memcheck|racecheck build/bin/test_gpu_attention --gtest_filter='*ForSanitizer*'
TEST(GpuFlashAttention, SmallShapesForSanitizer) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(6);
  std::vector<Case> cases = {fixed(1, 17, 17, 2, 64, true), fixed(1, 130, 60, 1, 128, true),
                             fixed(1, 70, 129, 1, 64, false, torch::kHalf),
                             varlen({3, 0, 80}, {5, 2, 65}, 2, 64, true), varlen({65, 1}, {1, 70}, 1, 128, false)};
  for (const Case& c : cases) {
    const Tensor dout = torch::randn(c.q.sizes(), c.q.options());
    const Result r = run_op(c, dout);
    EXPECT_TRUE(torch::isfinite(r.out).all().item<bool>()) << c.name;
    EXPECT_TRUE(torch::isfinite(r.dq).all().item<bool>() && torch::isfinite(r.dk).all().item<bool>() &&
                torch::isfinite(r.dv).all().item<bool>())
        << c.name;
  }
}

}  // namespace
