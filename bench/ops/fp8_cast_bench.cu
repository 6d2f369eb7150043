// The float8 cast kernels' versions side by side (docs/PERFORMANCE.md, "Float8 quantization"): v2 and v3
// of strobe/ops/cuda/fp8_kernels.cu, with the transposed copy (the cast a float8 linear's backward makes
// of its output gradient) and v3 with the column sums (its bias gradient), at the shapes of llama_1b and
// vit_l16. The amax is given (a producer's), so each row times the cast alone. Checks first: v3 writes
// v2's bytes (q and q_t), its column sums are within 1e-5 of a float64 sum of the same inputs, and a NaN
// reaches q and the sums; then CUDA events over 50 calls after 5 warm-up calls, each row against its HBM
// floor (x read once, q and q_t written) at 4.8 TB/s. No torch: build and run on a GPU machine with
//   nvcc -std=c++17 -O3 -arch=sm_90a -I. bench/ops/fp8_cast_bench.cu -o /tmp/fp8_cast_bench && /tmp/fp8_cast_bench
#include "strobe/ops/cuda/fp8_kernels.cu"

#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using strobe::ops::cuda::Fp8Format;
namespace k = strobe::ops::cuda;

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__global__ void fill(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * static_cast<int64_t>(blockDim.x)) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    x[i] = __float2bfloat16((static_cast<float>(h & 0xffffff) / 16777216.f - 0.5f) * 8.f);
  }
}

enum class Version { kV2, kV3, kV3Sums };

void cast(Version v, const __nv_bfloat16* x, int64_t rows, int64_t cols, bool transpose, float* amax, uint8_t* q, uint8_t* q_t,
          float* scale_inv, float* sums, float* work) {
  if (v == Version::kV2) {
    const dim3 grid((cols + 63) / 64, (rows + 63) / 64);
    k::cast_v2_kernel<__nv_bfloat16, Fp8Format::kE5M2><<<grid, 256>>>(x, rows, cols, amax, q, transpose ? q_t : nullptr, scale_inv);
    CK(cudaGetLastError());
    return;
  }
  CK(k::fp8_quantize(x, rows, cols, k::DType::kBFloat16, Fp8Format::kE5M2, q, transpose ? q_t : nullptr, amax, true,
                     scale_inv, v == Version::kV3Sums ? sums : nullptr, work, nullptr));
}

}  // namespace

int main() {
  struct Shape {
    const char* name;
    int64_t rows, cols;
  };
  const Shape shapes[] = {{"llama_1b d gate_up", 16384, 16384}, {"llama_1b d q / d down", 16384, 2048},
                          {"llama_1b x of down", 16384, 8192},  {"vit_l16 d fc1", 25216, 4096},
                          {"vit_l16 d qkv", 25216, 3072},       {"vit_l16 d fc2 / d proj", 25216, 1024}};
  bool ok = true;
  std::printf("| shape | rows x cols | v2 ms | v3 ms | v3 + column sums ms | floor ms (q + q_t) |\n| --- | --- | --- | --- | --- | --- |\n");
  for (const auto& s : shapes) {
    const int64_t n = s.rows * s.cols;
    __nv_bfloat16* x;
    uint8_t *q2, *qt2, *q3, *qt3;
    float *amax, *si, *sums, *work;
    CK(cudaMalloc(&x, n * 2));
    CK(cudaMalloc(&q2, n));
    CK(cudaMalloc(&qt2, n));
    CK(cudaMalloc(&q3, n));
    CK(cudaMalloc(&qt3, n));
    CK(cudaMalloc(&amax, 4));
    CK(cudaMalloc(&si, 4));
    CK(cudaMalloc(&sums, s.cols * 4));
    const int64_t wf = k::fp8_col_work_floats(x, s.rows, s.cols, true);
    CK(cudaMalloc(&work, std::max<int64_t>(wf, 1) * 4));
    fill<<<1024, 256>>>(x, n, 12345u + static_cast<uint32_t>(s.cols));
    const float a = 4.f;
    CK(cudaMemcpy(amax, &a, 4, cudaMemcpyHostToDevice));
    // Checks: poisoned outputs, v3's bytes against v2's, the sums against float64.
    CK(cudaMemset(q2, 0xff, n));
    CK(cudaMemset(qt2, 0xff, n));
    CK(cudaMemset(q3, 0xee, n));
    CK(cudaMemset(qt3, 0xee, n));
    CK(cudaMemset(sums, 0xff, s.cols * 4));
    cast(Version::kV2, x, s.rows, s.cols, true, amax, q2, qt2, si, sums, work);
    cast(Version::kV3Sums, x, s.rows, s.cols, true, amax, q3, qt3, si, sums, work);
    CK(cudaDeviceSynchronize());
    std::vector<uint8_t> h2(n), h3(n);
    CK(cudaMemcpy(h2.data(), q2, n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h3.data(), q3, n, cudaMemcpyDeviceToHost));
    const bool q_same = std::memcmp(h2.data(), h3.data(), n) == 0;
    CK(cudaMemcpy(h2.data(), qt2, n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h3.data(), qt3, n, cudaMemcpyDeviceToHost));
    const bool qt_same = std::memcmp(h2.data(), h3.data(), n) == 0;
    std::vector<__nv_bfloat16> hx(n);
    std::vector<float> hs(s.cols);
    CK(cudaMemcpy(hx.data(), x, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hs.data(), sums, s.cols * 4, cudaMemcpyDeviceToHost));
    std::vector<double> ref(s.cols, 0.0);
    for (int64_t r = 0; r < s.rows; ++r)
      for (int64_t c = 0; c < s.cols; ++c) ref[c] += static_cast<double>(__bfloat162float(hx[r * s.cols + c]));
    double num = 0, den = 0;
    bool finite = true;
    for (int64_t c = 0; c < s.cols; ++c) {
      finite = finite && std::isfinite(hs[c]);
      num += (hs[c] - ref[c]) * (hs[c] - ref[c]);
      den += ref[c] * ref[c];
    }
    const double rel = std::sqrt(num / den);
    // A NaN in one element reaches its q byte, its q_t byte and its column's sum.
    const __nv_bfloat16 nan = __float2bfloat16(NAN);
    const int64_t at_r = s.rows / 3, at_c = s.cols / 5;
    CK(cudaMemcpy(x + at_r * s.cols + at_c, &nan, 2, cudaMemcpyHostToDevice));
    cast(Version::kV3Sums, x, s.rows, s.cols, true, amax, q3, qt3, si, sums, work);
    uint8_t qb = 0, qtb = 0;
    float sb = 0;
    CK(cudaMemcpy(&qb, q3 + at_r * s.cols + at_c, 1, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&qtb, qt3 + at_c * s.rows + at_r, 1, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&sb, sums + at_c, 4, cudaMemcpyDeviceToHost));
    const bool nan_ok = (qb & 0x7f) > 0x7c && (qtb & 0x7f) > 0x7c && std::isnan(sb);  // e5m2 NaN: exponent all ones, mantissa != 0
    fill<<<1024, 256>>>(x, n, 777u + static_cast<uint32_t>(s.cols));
    const bool row_ok = q_same && qt_same && finite && rel < 1e-5 && nan_ok;
    ok = ok && row_ok;
    // Timing.
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float ms[3];
    for (int v = 0; v < 3; ++v) {
      for (int i = 0; i < 5; ++i) cast(static_cast<Version>(v), x, s.rows, s.cols, true, amax, q3, qt3, si, sums, work);
      CK(cudaEventRecord(e0));
      for (int i = 0; i < 50; ++i) cast(static_cast<Version>(v), x, s.rows, s.cols, true, amax, q3, qt3, si, sums, work);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      CK(cudaEventElapsedTime(&ms[v], e0, e1));
      ms[v] /= 50;
    }
    const double floor_ms = (n * 2.0 + 2.0 * n) / 4.8e12 * 1e3;
    std::printf("| %s | %lld x %lld | %.3f | %.3f | %.3f | %.3f |%s\n", s.name, static_cast<long long>(s.rows),
                static_cast<long long>(s.cols), ms[0], ms[1], ms[2], floor_ms,
                row_ok ? "" : " CHECK FAILED");
    if (!row_ok)
      std::printf("   q same %d, q_t same %d, sums finite %d, sums rel err %.3g, NaN reached %d\n", q_same, qt_same, finite, rel,
                  nan_ok);
    for (void* p : {static_cast<void*>(x), static_cast<void*>(q2), static_cast<void*>(qt2), static_cast<void*>(q3),
                    static_cast<void*>(qt3), static_cast<void*>(amax), static_cast<void*>(si), static_cast<void*>(sums),
                    static_cast<void*>(work)})
      CK(cudaFree(p));
  }
  std::printf(ok ? "checks passed\n" : "CHECKS FAILED\n");
  return ok ? 0 : 1;
}
