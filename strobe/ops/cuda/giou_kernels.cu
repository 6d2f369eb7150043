// GIoU loss forward+gradient (one pass), deterministic reduction, and backward scaling.
//
// Math: standard GIoU(targets, pred) as torchvision.ops.generalized_box_iou (the loss is the GIoU
// itself, no "1 -"; intersection sides clamped at 0; eps = 1e-5 clamps on union and enclosing
// area), evaluated in double so fp32 results match a float64 reference to output rounding. The
// seed's generalized_box_iou (bench/pytorch_baselines.py) does not clamp the sides, which makes the
// "intersection" of boxes disjoint on both axes positive and the loss diverge; we clamp. The
// gradient reproduces autograd of the clamped reference: max/min split the gradient in half on
// ties, clamp(min) passes it when x >= min (0 for the sides, eps for union and enclosing area).
//
// Versions (B=1024, N=256 is memory/launch bound; see docs/OPS.md for measured times):
//   1. seed: one thread per box, fp32 cast pass, ATen sum + mask sum (5+ launches).
//   2. this: native-dtype loads, per-box gradient written in the forward pass, per-block partials
//      (fixed-order tree) + one finalize block; backward is one scaling pass (3 launches total).
#include "strobe/ops/cuda/common.cuh"
#include "strobe/ops/cuda/launchers.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace strobe::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr double kEps = 1e-5;

template <typename T>
__device__ __forceinline__ double to_double(T v) {
  return static_cast<double>(v);
}
template <>
__device__ __forceinline__ double to_double<__half>(__half v) {
  return static_cast<double>(__half2float(v));
}
template <>
__device__ __forceinline__ double to_double<__nv_bfloat16>(__nv_bfloat16 v) {
  return static_cast<double>(__bfloat162float(v));
}

template <typename T>
using Vec4 = Pack<T, 4>;

// Rows are 4 contiguous elements starting at a multiple of 4, so a whole-row vector load is
// aligned whenever the base pointer is (the glue passes storage-aligned contiguous tensors).
template <typename T>
__device__ __forceinline__ void load_row(const void* base, int64_t row, double out[4]) {
  const Vec4<T> r = reinterpret_cast<const Vec4<T>*>(base)[row];
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = to_double(r.v[k]);
}

// d max(self, other)/d other, autograd's convention: 1 if other wins, 0.5 on a tie, 0 otherwise.
__device__ __forceinline__ double win_max(double other, double self) {
  return other > self ? 1.0 : (other == self ? 0.5 : 0.0);
}
__device__ __forceinline__ double win_min(double other, double self) {
  return other < self ? 1.0 : (other == self ? 0.5 : 0.0);
}

// giou(t, p) and d giou / d p.
__device__ __forceinline__ double giou_and_grad(const double t[4], const double p[4], double g[4]) {
  const double area1 = (t[2] - t[0]) * (t[3] - t[1]);
  const double pw = p[2] - p[0], ph = p[3] - p[1];
  const double area2 = pw * ph;
  const double ltx = fmax(t[0], p[0]), lty = fmax(t[1], p[1]);
  const double rbx = fmin(t[2], p[2]), rby = fmin(t[3], p[3]);
  const double w_raw = rbx - ltx, h_raw = rby - lty;
  const double w = fmax(w_raw, 0.0), h = fmax(h_raw, 0.0);  // clamp(min=0)
  const double inter = w * h;
  const double uni = area1 + area2 - inter;
  const double uc = fmax(uni, kEps);
  const double iou = inter / uc;
  const double eltx = fmin(t[0], p[0]), elty = fmin(t[1], p[1]);
  const double erbx = fmax(t[2], p[2]), erby = fmax(t[3], p[3]);
  const double ew = erbx - eltx, eh = erby - elty;
  const double ea_raw = ew * eh;
  const double ea = fmax(ea_raw, kEps);
  const double giou = iou - (ea - uni) / ea;

  // Backward of the expression above, term by term.
  const double g_ea = ea_raw >= kEps ? -uni / (ea * ea) : 0.0;  // d/d ea_raw
  const double g_uni = 1.0 / ea + (uni >= kEps ? -inter / (uc * uc) : 0.0);
  const double g_inter = 1.0 / uc - g_uni;
  // d clamp_min(x, 0)/dx = 1 where x >= 0 (autograd's convention), else 0.
  const double g_w = w_raw >= 0.0 ? g_inter * h : 0.0;
  const double g_h = h_raw >= 0.0 ? g_inter * w : 0.0;
  const double g_ew = g_ea * eh, g_eh = g_ea * ew;
  // area2 = (p2 - p0) * (p3 - p1), with d area2 = g_uni.
  g[0] = -g_uni * ph - g_w * win_max(p[0], t[0]) - g_ew * win_min(p[0], t[0]);
  g[1] = -g_uni * pw - g_h * win_max(p[1], t[1]) - g_eh * win_min(p[1], t[1]);
  g[2] = g_uni * ph + g_w * win_min(p[2], t[2]) + g_ew * win_max(p[2], t[2]);
  g[3] = g_uni * pw + g_h * win_min(p[3], t[3]) + g_eh * win_max(p[3], t[3]);
  return giou;
}

template <typename TP, typename TT>
__global__ void __launch_bounds__(kThreads) giou_fwd_kernel(const GiouFwdParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  double loss = 0.0;
  int valid = 0;
  if (row < p.rows) {
    int64_t trow = row;
    if (p.layout == GiouLayout::kPackedTargets) {
      const int64_t b = row / p.boxes_per_image, j = row - b * p.boxes_per_image;
      const int64_t begin = p.offsets[b];
      trow = begin + j;
      valid = j < p.offsets[b + 1] - begin && trow < p.target_rows;
    } else {
      valid = 1;
    }
    double t[4] = {0.0, 0.0, 0.0, 0.0};
    if (valid) load_row<TT>(p.target, trow, t);
    if (p.layout == GiouLayout::kPadded) valid = t[3] > 0.0;
    double g[4] = {0.0, 0.0, 0.0, 0.0};
    if (valid) {
      double pr[4];
      load_row<TP>(p.pred, row, pr);
      loss = giou_and_grad(t, pr, g);
    }
    if (p.grad_box != nullptr) {
      reinterpret_cast<float4*>(p.grad_box)[row] =
          make_float4(static_cast<float>(g[0]), static_cast<float>(g[1]),
                      static_cast<float>(g[2]), static_cast<float>(g[3]));
    }
    if (p.per_box_loss != nullptr) p.per_box_loss[row] = static_cast<float>(loss);
  }
  if (p.partial_sum == nullptr) return;

  // Fixed-shape tree: warp shuffles, then warp 0 over the warp sums.
  __shared__ float sh_s[kThreads / 32];
  __shared__ int sh_c[kThreads / 32];
  const float s = block_sum_to_thread0<kThreads>(static_cast<float>(loss), sh_s);
  const int c = block_sum_to_thread0<kThreads>(valid, sh_c);
  if (threadIdx.x == 0) {
    p.partial_sum[blockIdx.x] = s;
    p.partial_count[blockIdx.x] = c;
  }
}

constexpr int kFinalizeThreads = 512;

__global__ void __launch_bounds__(kFinalizeThreads)
    giou_finalize_kernel(const float* partial_sum, const int* partial_count, int64_t n, bool mean,
                         float* loss, float* scale) {
  __shared__ double sh_sum[kFinalizeThreads];
  __shared__ long long sh_count[kFinalizeThreads];
  double s = 0.0;
  long long c = 0;
  for (int64_t i = threadIdx.x; i < n; i += kFinalizeThreads) {
    s += partial_sum[i];
    c += partial_count[i];
  }
  sh_sum[threadIdx.x] = s;
  sh_count[threadIdx.x] = c;
  __syncthreads();
  for (int half = kFinalizeThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) {
      sh_sum[threadIdx.x] += sh_sum[threadIdx.x + half];
      sh_count[threadIdx.x] += sh_count[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double count = sh_count[0] > 0 ? static_cast<double>(sh_count[0]) : 1.0;
    *loss = static_cast<float>(mean ? sh_sum[0] / count : sh_sum[0]);
    *scale = static_cast<float>(mean ? 1.0 / count : 1.0);
  }
}

template <typename TP>
__global__ void __launch_bounds__(kThreads)
    giou_bwd_kernel(const float* grad_out, bool per_box, const float* scale, const float4* grad_box,
                    Vec4<TP>* grad_pred, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= rows) return;
  const float k = per_box ? grad_out[row] : grad_out[0] * scale[0];
  const float4 g = grad_box[row];
  Vec4<TP> out;
  out.v[0] = from_f<TP>(k * g.x);
  out.v[1] = from_f<TP>(k * g.y);
  out.v[2] = from_f<TP>(k * g.z);
  out.v[3] = from_f<TP>(k * g.w);
  grad_pred[row] = out;
}

}  // namespace

int64_t giou_fwd_num_blocks(int64_t rows) { return (rows + kThreads - 1) / kThreads; }

cudaError_t giou_fwd(const GiouFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(giou_fwd_num_blocks(p.rows)));
  // Predictions in fp32, fp16 or bf16; targets in those or fp64.
  return dispatch_float(p.pred_dtype, [&](auto tp) {
    return dispatch_float_or_double(p.target_dtype, [&](auto tt) {
      giou_fwd_kernel<typename decltype(tp)::type, typename decltype(tt)::type><<<grid, kThreads, 0, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

cudaError_t giou_finalize(const float* partial_sum, const int* partial_count, int64_t n, bool mean,
                          float* loss, float* scale, cudaStream_t stream) {
  giou_finalize_kernel<<<1, kFinalizeThreads, 0, stream>>>(partial_sum, partial_count, n, mean,
                                                           loss, scale);
  return cudaGetLastError();
}

cudaError_t giou_bwd(const float* grad_out, bool per_box, const float* scale, const float* grad_box,
                     void* grad_pred, DType pred_dtype, int64_t rows, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((rows + kThreads - 1) / kThreads));
  const auto* gb = reinterpret_cast<const float4*>(grad_box);
  return dispatch_float(pred_dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    giou_bwd_kernel<T><<<grid, kThreads, 0, stream>>>(grad_out, per_box, scale, gb, static_cast<Vec4<T>*>(grad_pred), rows);
    return cudaGetLastError();
  });
}

}  // namespace strobe::ops::cuda
