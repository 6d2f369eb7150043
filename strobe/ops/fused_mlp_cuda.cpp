// cuBLASLt glue of fused_mlp_fwd / _bwd (the CPU reference and autograd: fused_mlp.cpp). The handle,
// workspace and stream are ATen's (at::cuda::getCurrentCUDABlasLtHandle, getCUDABlasLtWorkspace, the
// current stream), so these GEMMs queue and share memory exactly like ATen's own. Row-major tensors
// are handed to column-major cuBLASLt transposed (C^T = B^T A^T). If cuBLASLt offers no algorithm
// for a shape / dtype with the GELU epilogue the call fails with a message naming it: no silent
// fallback (the models choose this path explicitly, docs/CONFIG.md).
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/library.h>

#include "strobe/ops/cuda_glue.h"

namespace strobe::ops {
namespace detail {
void fused_mlp_check_inputs(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                            const at::Tensor& b2);
}  // namespace detail

namespace {

using at::Tensor;

#define LT_CHECK(expr, what)                                                                            \
  do {                                                                                                  \
    const cublasStatus_t st_ = (expr);                                                                  \
    TORCH_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "fused_mlp (cuBLASLt): ", what, " failed with status ", \
                static_cast<int>(st_), " (", cublasGetStatusString(st_), ")");                         \
  } while (0)

cudaDataType_t lt_type(at::ScalarType s) {
  switch (s) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK(false, "fused_mlp (CUDA): dtype must be bfloat16, float16 or float32, got ", s);
  }
}

// One column-major GEMM D[m, n] = op(A) op(B) with a GELU epilogue: bias (fwd: input, bwd: the
// bias-gradient output) and aux (fwd: pre-activation output, bwd: its input), aux ld = m.
struct Gemm {
  cublasLtEpilogue_t epilogue;
  bool trans_a;
  int64_t m, n, k, lda, ldb;
  const void *a, *b;
  void* d;
  void* bias;
  void* aux;
  at::ScalarType dtype;
};

struct AlgoKey {
  int epilogue, trans_a, dtype;
  int64_t m, n, k, lda, ldb;
  bool operator==(const AlgoKey& o) const { return std::memcmp(this, &o, sizeof(AlgoKey)) == 0; }
};
struct AlgoKeyHash {
  size_t operator()(const AlgoKey& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : {int64_t(k.epilogue), int64_t(k.trans_a), int64_t(k.dtype), k.m, k.n, k.k, k.lda, k.ldb})
      h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};

void run_gemm(const Gemm& g, const char* what) {
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const cudaDataType_t t = lt_type(g.dtype);
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LT_CHECK(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F), "MatmulDescCreate");
  const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "TRANSA");
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "TRANSB");
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &g.epilogue, sizeof(g.epilogue)),
           "EPILOGUE");
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)), "BIAS");
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)),
           "AUX_POINTER");
  const int64_t aux_ld = g.m;
  LT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)),
           "AUX_LD");
  // A is (trans_a ? k x m : m x k) column-major; B is k x n; D is m x n, ld m.
  LT_CHECK(cublasLtMatrixLayoutCreate(&la, t, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda), "layout A");
  LT_CHECK(cublasLtMatrixLayoutCreate(&lb, t, g.k, g.n, g.ldb), "layout B");
  LT_CHECK(cublasLtMatrixLayoutCreate(&ld, t, g.m, g.n, g.m), "layout D");
  const size_t ws_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* ws = at::cuda::getCUDABlasLtWorkspace();

  static std::mutex mu;
  static std::unordered_map<AlgoKey, cublasLtMatmulAlgo_t, AlgoKeyHash> cache;
  AlgoKey key{};
  key.epilogue = static_cast<int>(g.epilogue);
  key.trans_a = g.trans_a;
  key.dtype = static_cast<int>(g.dtype);
  key.m = g.m;
  key.n = g.n;
  key.k = g.k;
  key.lda = g.lda;
  key.ldb = g.ldb;
  cublasLtMatmulAlgo_t algo;
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      algo = it->second;
      found = true;
    }
  }
  if (!found) {
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                                                  sizeof(ws_size)),
             "MAX_WORKSPACE");
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, 1, &result, &returned), "heuristic");
    cublasLtMatmulPreferenceDestroy(pref);
    TORCH_CHECK(returned > 0, "fused_mlp (cuBLASLt): no algorithm for ", what, " (", c10::toString(g.dtype), ", m=",
                g.m, " n=", g.n, " k=", g.k, "); set model.fused_ops: false");
    algo = result.algo;
    std::lock_guard<std::mutex> lock(mu);
    cache.emplace(key, algo);
  }
  const float alpha = 1.f, beta = 0.f;
  LT_CHECK(cublasLtMatmul(handle, desc, &alpha, g.a, la, g.b, lb, &beta, g.d, ld, g.d, ld, &algo, ws, ws_size,
                          detail::current_stream()),
           what);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
}

void check_cuda_shapes(const Tensor& x, const Tensor& w1, const Tensor& w2) {
  const int64_t c = x.size(-1), h = w1.size(0), n = w2.size(0);
  TORCH_CHECK(c % 8 == 0 && h % 8 == 0 && n % 8 == 0,
              "fused_mlp (CUDA): in, hidden and out features must be multiples of 8 (cuBLASLt's GELU aux "
              "layout), got ", c, ", ", h, ", ", n);
}

std::tuple<Tensor, Tensor, Tensor> mlp_fwd_cuda(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                                            const Tensor& b2) {
  detail::fused_mlp_check_inputs(x, w1, b1, w2, b2);
  check_cuda_shapes(x, w1, w2);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t c = x.size(-1), h = w1.size(0), m = x.numel() / c;
  const Tensor x2 = x.reshape({m, c}).contiguous();
  const Tensor w1c = w1.contiguous(), b1c = b1.contiguous(), w2c = w2.contiguous();
  Tensor act = at::empty({m, h}, x2.options()), pre = at::empty({m, h}, x2.options());
  if (m > 0) {
    // act^T [h, m] = gelu(w1 [h, c] . x^T [c, m] + b1): A = w1 (column-major c x h, transposed).
    run_gemm({CUBLASLT_EPILOGUE_GELU_AUX_BIAS, true, h, m, c, c, c, w1c.data_ptr(), x2.data_ptr(), act.data_ptr(),
              b1c.data_ptr(), pre.data_ptr(), x.scalar_type()},
             "fc1 GEMM with GELU_AUX_BIAS");
  }
  Tensor y = at::addmm(b2, act, w2c.t());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w2.size(0);
  return {y.view(shape), act, pre};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> mlp_bwd_cuda(const Tensor& dy, const Tensor& x, const Tensor& w1,
                                                            const Tensor& w2, const Tensor& act, const Tensor& pre) {
  check_cuda_shapes(x, w1, w2);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t c = x.size(-1), h = w1.size(0), n = w2.size(0), m = x.numel() / c;
  TORCH_CHECK(dy.numel() == m * n && dy.scalar_type() == x.scalar_type(), "fused_mlp_bwd: dy must be [", m, ", ", n,
              "] of x's dtype");
  TORCH_CHECK(pre.sizes() == at::IntArrayRef({m, h}) && pre.is_contiguous() && act.sizes() == pre.sizes(),
              "fused_mlp_bwd: act / pre must be contiguous [", m, ", ", h, "]");
  const Tensor dy2 = dy.reshape({m, n}).contiguous(), x2 = x.reshape({m, c}).contiguous();
  const Tensor w2c = w2.contiguous();
  Tensor dpre = at::empty({m, h}, x2.options());
  Tensor db1 = at::empty({h}, x2.options());
  if (m > 0) {
    // dpre^T [h, m] = dgelu(w2^T [h, n] . dy^T [n, m], pre), db1 = its row sums: A = w2 (column-major
    // h x n, not transposed), B = dy^T (n x m).
    run_gemm({CUBLASLT_EPILOGUE_DGELU_BGRAD, false, h, m, n, h, n, w2c.data_ptr(), dy2.data_ptr(), dpre.data_ptr(),
              db1.data_ptr(), const_cast<void*>(pre.data_ptr()), x.scalar_type()},
             "fc2 data-gradient GEMM with DGELU_BGRAD");
  } else {
    db1.zero_();
  }
  Tensor dx = dpre.mm(w1).view(x.sizes());
  Tensor dw1 = dpre.t().mm(x2);
  Tensor dw2 = dy2.t().mm(act);
  Tensor db2 = dy2.sum(0);
  return {dx, dw1, db1, dw2, db2};
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("fused_mlp_fwd", &strobe::ops::mlp_fwd_cuda);
  m.impl("fused_mlp_bwd", &strobe::ops::mlp_bwd_cuda);
}
