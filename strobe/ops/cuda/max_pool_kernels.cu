// Max-pool forward and backward (launchers in max_pool.h). ATen's kernels store an int64 index per
// output and its backward over channels-last bf16 (ResNet's stem) runs far from memory bandwidth;
// here the index is one byte (the position inside the window) and the backward is a gather: one
// thread per input element (x a vector of channels in NHWC) reads the outputs whose window covers it
// and sums the gradients of those that chose it, so every grad_x element is written exactly once
// (no memset pass, no atomics, a fixed summation order).
//
// Sizes inside the kernels are 32-bit: the launchers split the batch into chunks of fewer than 2^31
// elements (a chunk is one launch; the usual case is one chunk).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>

#include "strobe/ops/cuda/common.cuh"
#include "strobe/ops/cuda/max_pool.h"

namespace strobe::ops::cuda {
namespace {

constexpr int kThreads = 256;

// Raw storage of `Bytes` bytes, so one vector moves in a single load or store.
template <int Bytes>
struct Raw;
template <>
struct Raw<16> { using type = uint4; };
template <>
struct Raw<8> { using type = uint2; };
template <>
struct Raw<4> { using type = uint32_t; };
template <>
struct Raw<2> { using type = uint16_t; };
template <>
struct Raw<1> { using type = uint8_t; };

// 32-bit word k of a raw vector (constant k after unrolling: registers, never local memory).
__device__ __forceinline__ uint32_t word(const uint4& r, int k) { return k == 0 ? r.x : k == 1 ? r.y : k == 2 ? r.z : r.w; }
__device__ __forceinline__ uint32_t word(const uint2& r, int k) { return k == 0 ? r.x : r.y; }
__device__ __forceinline__ uint32_t word(uint32_t r, int) { return r; }
__device__ __forceinline__ uint32_t word(uint16_t r, int) { return r; }
__device__ __forceinline__ uint32_t word(uint8_t r, int) { return r; }
__device__ __forceinline__ void set_word(uint4& r, int k, uint32_t v) { (k == 0 ? r.x : k == 1 ? r.y : k == 2 ? r.z : r.w) = v; }
__device__ __forceinline__ void set_word(uint2& r, int k, uint32_t v) { (k == 0 ? r.x : r.y) = v; }
__device__ __forceinline__ void set_word(uint32_t& r, int, uint32_t v) { r = v; }
__device__ __forceinline__ void set_word(uint16_t& r, int, uint32_t v) { r = static_cast<uint16_t>(v); }
__device__ __forceinline__ void set_word(uint8_t& r, int, uint32_t v) { r = static_cast<uint8_t>(v); }

// An element's bits <-> float.
template <typename T>
__device__ __forceinline__ float bits_to_f(uint32_t b);
template <>
__device__ __forceinline__ float bits_to_f<float>(uint32_t b) { return __uint_as_float(b); }
template <>
__device__ __forceinline__ float bits_to_f<__nv_bfloat16>(uint32_t b) {
  return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b)));
}
template <>
__device__ __forceinline__ float bits_to_f<__half>(uint32_t b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}
template <typename T>
__device__ __forceinline__ uint32_t f_to_bits(float v);
template <>
__device__ __forceinline__ uint32_t f_to_bits<float>(float v) { return __float_as_uint(v); }
template <>
__device__ __forceinline__ uint32_t f_to_bits<__nv_bfloat16>(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
template <>
__device__ __forceinline__ uint32_t f_to_bits<__half>(float v) { return __half_as_ushort(__float2half_rn(v)); }

// N elements of E moved in a single load or store (E: float, bf16, fp16 or uint8).
template <typename E, int N>
struct Vec {
  using R = typename Raw<sizeof(E) * N>::type;
  static constexpr int kBits = 8 * sizeof(E);
  R raw;
  __device__ __forceinline__ void load(const E* p) { raw = *reinterpret_cast<const R*>(p); }
  __device__ __forceinline__ void store(E* p) const { *reinterpret_cast<R*>(p) = raw; }
  // Element i's bits (in the low kBits bits).
  __device__ __forceinline__ uint32_t bits(int i) const {
    const uint32_t w = word(raw, i * kBits / 32);
    return kBits == 32 ? w : (w >> (i * kBits % 32)) & ((1u << (kBits % 32)) - 1);
  }
  // Sets element i to the bits f(i) returns, a 32-bit word at a time.
  template <typename F>
  __device__ __forceinline__ void fill(F f) {
    constexpr int per_word = kBits >= 32 ? 1 : 32 / kBits;
    constexpr int words = (N + per_word - 1) / per_word;
#pragma unroll
    for (int k = 0; k < words; ++k) {
      uint32_t w = 0;
#pragma unroll
      for (int e = 0; e < per_word; ++e)
        if (k * per_word + e < N) w |= f(k * per_word + e) << (e * kBits % 32);
      set_word(raw, k, w);
    }
  }
};

// n / d for 0 <= n < 2^31 by a multiply-high and a shift (the divisor's magic number computed on the
// host, as ATen's IntDivider): the kernels are light on memory per thread, and hardware-less 32-bit
// division (~20 instructions each, ten per thread) made the first version instruction-bound
// (the NCHW backward ran at 295 GB/s on an H200).
struct FastDiv {
  uint32_t d = 1, m = 1, shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    while (shift < 32 && (1u << shift) < d) ++shift;
    m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ int div(int n) const {
    const uint32_t u = static_cast<uint32_t>(n);
    return static_cast<int>((__umulhi(u, m) + u) >> shift);
  }
  // q = n / d, returns n % d
  __device__ __forceinline__ int divmod(int n, int& q) const {
    q = div(n);
    return n - q * static_cast<int>(d);
  }
};

// The divisors the kernels need.
struct Divs {
  FastDiv cv, w, h, ow, oh, sh, sw;
};

// Outputs [lo, hi] along one axis whose window (start o * stride - pad, length k) covers input i.
__device__ __forceinline__ void covering(int i, int k, const FastDiv& stride, int pad, int outs, int& lo, int& hi) {
  const int a = i + pad - k + 1;
  lo = a <= 0 ? 0 : stride.div(a + static_cast<int>(stride.d) - 1);
  hi = min(stride.div(i + pad), outs - 1);
}

// The window of output (oh, ow): rows [ya, yb), columns [xa, xb) inside the image, corner (h0, w0).
struct Window {
  int h0, w0, ya, yb, xa, xb;
  __device__ __forceinline__ Window(const PoolShape& s, int oh, int ow) {
    h0 = oh * s.sh - s.ph, w0 = ow * s.sw - s.pw;
    ya = max(h0, 0), yb = min(h0 + s.kh, s.h), xa = max(w0, 0), xb = min(w0 + s.kw, s.w);
  }
};

// One thread per (output pixel, vector of VEC channels) of a channels-last chunk of n images.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    fwd_nhwc(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ index, PoolShape s, Divs dv, int n) {
  const int cv = s.c / VEC;
  const int total = n * s.oh * s.ow * cv;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < total; i += gridDim.x * kThreads) {
    int p, q, img;
    const int g = dv.cv.divmod(i, p);
    const int ow = dv.ow.divmod(p, q);
    const int oh = dv.oh.divmod(q, img);
    const Window win(s, oh, ow);
    float best[VEC];
    uint8_t arg[VEC];
    const uint8_t first = static_cast<uint8_t>((win.ya - win.h0) * s.kw + (win.xa - win.w0));
#pragma unroll
    for (int j = 0; j < VEC; ++j) best[j] = -INFINITY, arg[j] = first;
    for (int yy = win.ya; yy < win.yb; ++yy) {
      const T* row = x + (static_cast<int>(img * s.h + yy) * s.w) * s.c + g * VEC;
      for (int xx = win.xa; xx < win.xb; ++xx) {
        const uint8_t pos = static_cast<uint8_t>((yy - win.h0) * s.kw + (xx - win.w0));
        Vec<T, VEC> v;
        v.load(row + xx * s.c);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float f = bits_to_f<T>(v.bits(j));
          // ATen's rule: strictly greater (the first maximum stays), and a NaN always takes over.
          if (f > best[j] || isnan(f)) best[j] = f, arg[j] = pos;
        }
      }
    }
    Vec<T, VEC> out;
    Vec<uint8_t, VEC> idx;
    out.fill([&](int j) { return f_to_bits<T>(best[j]); });
    idx.fill([&](int j) { return static_cast<uint32_t>(arg[j]); });
    out.store(y + p * s.c + g * VEC);
    idx.store(index + p * s.c + g * VEC);
  }
}

// One thread per (input pixel, vector of VEC channels) of a channels-last chunk.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) bwd_nhwc(const T* __restrict__ grad_y, const uint8_t* __restrict__ index,
                                                     T* __restrict__ grad_x, PoolShape s, Divs dv, int n) {
  const int cv = s.c / VEC;
  const int total = n * s.h * s.w * cv;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < total; i += gridDim.x * kThreads) {
    int p, q, img;
    const int g = dv.cv.divmod(i, p);
    const int ix = dv.w.divmod(p, q);
    const int iy = dv.h.divmod(q, img);
    int oh0, oh1, ow0, ow1;
    covering(iy, s.kh, dv.sh, s.ph, s.oh, oh0, oh1);
    covering(ix, s.kw, dv.sw, s.pw, s.ow, ow0, ow1);
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
    // Row-major output order: the order in which ATen's backward adds into grad_x.
    for (int oh = oh0; oh <= oh1; ++oh) {
      for (int ow = ow0; ow <= ow1; ++ow) {
        const int o = ((img * s.oh + oh) * s.ow + ow) * s.c + g * VEC;
        const int pos = (iy - (oh * s.sh - s.ph)) * s.kw + (ix - (ow * s.sw - s.pw));
        Vec<uint8_t, VEC> iv;
        iv.load(index + o);
        int idx[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) idx[j] = static_cast<int>(iv.bits(j));
        bool hit = false;
#pragma unroll
        for (int j = 0; j < VEC; ++j) hit |= idx[j] == pos;
        if (!hit) continue;  // most windows chose another element: skip reading their gradient
        Vec<T, VEC> gv;
        gv.load(grad_y + o);
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          if (idx[j] == pos) acc[j] += bits_to_f<T>(gv.bits(j));
      }
    }
    Vec<T, VEC> out;
    out.fill([&](int j) { return f_to_bits<T>(acc[j]); });
    out.store(grad_x + p * s.c + g * VEC);
  }
}

// One thread per output element of a contiguous NCHW chunk (n images).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    fwd_nchw(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ index, PoolShape s, Divs dv, int n) {
  const int total = n * s.c * s.oh * s.ow;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < total; i += gridDim.x * kThreads) {
    int q, plane;
    const int ow = dv.ow.divmod(i, q);
    const int oh = dv.oh.divmod(q, plane);
    const Window win(s, oh, ow);
    const T* base = x + plane * s.h * s.w;
    float best = -INFINITY;
    uint8_t arg = static_cast<uint8_t>((win.ya - win.h0) * s.kw + (win.xa - win.w0));
    for (int yy = win.ya; yy < win.yb; ++yy) {
      for (int xx = win.xa; xx < win.xb; ++xx) {
        const float f = to_f(base[yy * s.w + xx]);
        if (f > best || isnan(f)) best = f, arg = static_cast<uint8_t>((yy - win.h0) * s.kw + (xx - win.w0));
      }
    }
    y[i] = from_f<T>(best);
    index[i] = arg;
  }
}

// One thread per input element of a contiguous NCHW chunk.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_nchw(const T* __restrict__ grad_y, const uint8_t* __restrict__ index,
                                                     T* __restrict__ grad_x, PoolShape s, Divs dv, int n) {
  const int total = n * s.c * s.h * s.w;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < total; i += gridDim.x * kThreads) {
    int q, plane;
    const int ix = dv.w.divmod(i, q);
    const int iy = dv.h.divmod(q, plane);
    int oh0, oh1, ow0, ow1;
    covering(iy, s.kh, dv.sh, s.ph, s.oh, oh0, oh1);
    covering(ix, s.kw, dv.sw, s.pw, s.ow, ow0, ow1);
    float acc = 0.f;
    for (int oh = oh0; oh <= oh1; ++oh) {
      for (int ow = ow0; ow <= ow1; ++ow) {
        const int o = (plane * s.oh + oh) * s.ow + ow;
        if (index[o] == (iy - (oh * s.sh - s.ph)) * s.kw + (ix - (ow * s.sw - s.pw))) acc += to_f(grad_y[o]);
      }
    }
    grad_x[i] = from_f<T>(acc);
  }
}

int blocks_for(int64_t threads) {
  return static_cast<int>(std::min<int64_t>((threads + kThreads - 1) / kThreads, 1 << 20));
}

template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

Divs divisors(const PoolShape& s, int vec) {
  Divs d;
  d.cv = FastDiv(static_cast<uint32_t>(s.c / vec));
  d.w = FastDiv(s.w), d.h = FastDiv(s.h), d.ow = FastDiv(s.ow), d.oh = FastDiv(s.oh);
  d.sh = FastDiv(s.sh), d.sw = FastDiv(s.sw);
  return d;
}

template <typename T>
cudaError_t fwd_typed(const T* x, T* y, uint8_t* index, const PoolShape& s, bool vec, cudaStream_t stream) {
  const Divs dv = divisors(s, vec ? kVec<T> : 1);
  const int64_t per_img = std::max<int64_t>(int64_t{s.c} * s.h * s.w, int64_t{s.c} * s.oh * s.ow);
  const int64_t chunk = std::max<int64_t>(1, INT_MAX / std::max<int64_t>(per_img, 1));
  const int64_t in_img = int64_t{s.c} * s.h * s.w, out_img = int64_t{s.c} * s.oh * s.ow;
  for (int64_t n0 = 0; n0 < s.n; n0 += chunk) {
    const int n = static_cast<int>(std::min(chunk, s.n - n0));
    const T* xc = x + n0 * in_img;
    T* yc = y + n0 * out_img;
    uint8_t* ic = index + n0 * out_img;
    if (!s.channels_last) {
      fwd_nchw<T><<<blocks_for(n * out_img), kThreads, 0, stream>>>(xc, yc, ic, s, dv, n);
    } else if (vec) {
      fwd_nhwc<T, kVec<T>><<<blocks_for(n * out_img / kVec<T>), kThreads, 0, stream>>>(xc, yc, ic, s, dv, n);
    } else {
      fwd_nhwc<T, 1><<<blocks_for(n * out_img), kThreads, 0, stream>>>(xc, yc, ic, s, dv, n);
    }
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t bwd_typed(const T* grad_y, const uint8_t* index, T* grad_x, const PoolShape& s, bool vec,
                      cudaStream_t stream) {
  const Divs dv = divisors(s, vec ? kVec<T> : 1);
  const int64_t in_img = int64_t{s.c} * s.h * s.w, out_img = int64_t{s.c} * s.oh * s.ow;
  const int64_t chunk = std::max<int64_t>(1, INT_MAX / std::max<int64_t>(std::max(in_img, out_img), 1));
  for (int64_t n0 = 0; n0 < s.n; n0 += chunk) {
    const int n = static_cast<int>(std::min(chunk, s.n - n0));
    const T* gyc = grad_y + n0 * out_img;
    const uint8_t* ic = index + n0 * out_img;
    T* gxc = grad_x + n0 * in_img;
    if (!s.channels_last) {
      bwd_nchw<T><<<blocks_for(n * in_img), kThreads, 0, stream>>>(gyc, ic, gxc, s, dv, n);
    } else if (vec) {
      bwd_nhwc<T, kVec<T>><<<blocks_for(n * in_img / kVec<T>), kThreads, 0, stream>>>(gyc, ic, gxc, s, dv, n);
    } else {
      bwd_nhwc<T, 1><<<blocks_for(n * in_img), kThreads, 0, stream>>>(gyc, ic, gxc, s, dv, n);
    }
  }
  return cudaGetLastError();
}

}  // namespace

bool max_pool_vectorized(const PoolShape& s, DType dtype, const void* a, const void* b, const void* index) {
  const int vec = dtype == DType::kFloat32 ? kVec<float> : kVec<__half>;
  // index vectors are VEC bytes: aligned when the base is 16-byte aligned and c % VEC == 0
  return s.channels_last && s.c % vec == 0 && aligned16(a) && aligned16(b) && aligned16(index);
}

cudaError_t max_pool_fwd(const void* x, void* y, uint8_t* index, DType dtype, const PoolShape& s,
                         cudaStream_t stream) {
  if (s.n == 0 || s.c == 0 || s.oh == 0 || s.ow == 0) return cudaSuccess;
  const bool vec = max_pool_vectorized(s, dtype, x, y, index);
  return dispatch_float(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return fwd_typed(static_cast<const T*>(x), static_cast<T*>(y), index, s, vec, stream);
  });
}

cudaError_t max_pool_bwd(const void* grad_y, const uint8_t* index, void* grad_x, DType dtype,
                         const PoolShape& s, cudaStream_t stream) {
  if (s.n == 0 || s.c == 0 || s.h == 0 || s.w == 0) return cudaSuccess;
  const bool vec = max_pool_vectorized(s, dtype, grad_y, grad_x, index);
  return dispatch_float(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return bwd_typed(static_cast<const T*>(grad_y), index, static_cast<T*>(grad_x), s, vec, stream);
  });
}

}  // namespace strobe::ops::cuda
