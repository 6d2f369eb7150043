#include "data/image_transforms.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace strobe::data {
namespace {

// PIL's resampling coefficients (Imaging/Resample.c, precompute_coeffs) for the bilinear filter.
struct Taps {
  std::vector<int> first, count;
  std::vector<float> w;  // out_size x stride
  int stride = 0;
};

Taps make_taps(double start, double len, int in_size, int out_size) {
  Taps t;
  const double scale = len / out_size;
  const double fscale = std::max(scale, 1.0);
  const double support = fscale;  // bilinear support 1.0, widened when downscaling
  t.stride = static_cast<int>(std::ceil(support)) * 2 + 1;
  t.first.resize(out_size);
  t.count.resize(out_size);
  t.w.assign(static_cast<size_t>(out_size) * t.stride, 0.f);
  for (int i = 0; i < out_size; ++i) {
    const double center = start + (i + 0.5) * scale;
    int lo = static_cast<int>(std::floor(center - support + 0.5));
    int hi = static_cast<int>(std::floor(center + support + 0.5));
    lo = std::clamp(lo, 0, in_size - 1);
    hi = std::clamp(hi, lo + 1, in_size);
    int n = std::min(hi - lo, t.stride);
    double sum = 0;
    float* w = &t.w[static_cast<size_t>(i) * t.stride];
    for (int k = 0; k < n; ++k) {
      double x = (lo + k - center + 0.5) / fscale;
      double v = std::max(0.0, 1.0 - std::abs(x));
      w[k] = static_cast<float>(v);
      sum += v;
    }
    if (sum <= 0) {  // the box lies beyond the image edge: take the nearest pixel
      w[0] = 1.f;
      n = 1;
      sum = 1;
    }
    for (int k = 0; k < n; ++k) w[k] = static_cast<float>(w[k] / sum);
    t.first[i] = lo;
    t.count[i] = n;
  }
  return t;
}

// Horizontal then vertical pass; calls emit(c, y, row) with channel c's output row y (out_w values,
// 0..255 scale).
template <typename Emit>
void resample(const Image& img, const CropBox& box, int out_w, int out_h, Emit emit) {
  const int C = img.channels;
  // Taps over the whole scaled image; the pixels held may be a region of it (decode_image_into with
  // a DecodeRegion), which holds every pixel the taps read.
  const int sw = img.scaled_width > 0 ? img.scaled_width : img.width, sh = img.scaled_height > 0 ? img.scaled_height : img.height;
  const double sx = static_cast<double>(sw) / img.full_width, sy = static_cast<double>(sh) / img.full_height;
  Taps tx = make_taps(box.x * sx, box.w * sx, sw, out_w);
  Taps ty = make_taps(box.y * sy, box.h * sy, sh, out_h);
  for (auto& f : tx.first) f -= img.x0;
  for (auto& f : ty.first) f -= img.y0;
  const int row0 = ty.first.front();
  int row1 = row0;
  for (int i = 0; i < out_h; ++i) row1 = std::max(row1, ty.first[i] + ty.count[i]);
  int col1 = 0;
  for (int i = 0; i < out_w; ++i) col1 = std::max(col1, tx.first[i] + tx.count[i]);
  if (row0 < 0 || row1 > img.height || tx.first.front() < 0 || col1 > img.width)
    throw std::logic_error("resample: the decoded region does not hold the pixels the box reads");
  // Only the rows the vertical pass reads.
  // The horizontal pass writes channel planes of the rows the vertical pass reads, so the vertical
  // pass and the output run over contiguous floats of one channel (vectorized by the compiler).
  const int rows = row1 - row0;
  const size_t plane_in = static_cast<size_t>(rows) * out_w;
  thread_local std::vector<float> tmp, acc;  // reused by each loader thread (never shrinks)
  if (tmp.size() < plane_in * C) tmp.resize(plane_in * C);
  if (acc.size() < static_cast<size_t>(out_w)) acc.resize(out_w);
  for (int y = row0; y < row1; ++y) {
    const uint8_t* src = img.pixels.data() + static_cast<size_t>(y) * img.width * C;
    float* dst = tmp.data() + static_cast<size_t>(y - row0) * out_w;  // channel c at dst[c * plane_in + x]
    for (int x = 0; x < out_w; ++x) {
      const float* w = &tx.w[static_cast<size_t>(x) * tx.stride];
      const uint8_t* s = src + static_cast<size_t>(tx.first[x]) * C;
      const int n = tx.count[x];
#if defined(__SSE2__)
      // The three channels in the lanes of one vector (a 4-byte load: the byte after the pixel is the
      // next pixel's or the next row's, so not on the buffer's last row): each lane multiplies and
      // adds in the scalar loop's order, so the sums are the scalar loop's bit for bit.
      if (C == 3 && y + 1 < img.height) {
        const __m128i zero = _mm_setzero_si128();
        __m128 sum = _mm_setzero_ps();
        for (int k = 0; k < n; ++k) {
          int32_t v;
          std::memcpy(&v, s + 3 * k, 4);
          const __m128i p = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(v), zero), zero);
          sum = _mm_add_ps(sum, _mm_mul_ps(_mm_set1_ps(w[k]), _mm_cvtepi32_ps(p)));
        }
        alignas(16) float o[4];
        _mm_store_ps(o, sum);
        dst[x] = o[0];
        dst[plane_in + x] = o[1];
        dst[2 * plane_in + x] = o[2];
        continue;
      }
#endif
      for (int ch = 0; ch < C; ++ch) {
        float a = 0;
        for (int k = 0; k < n; ++k) a += w[k] * s[C * k + ch];
        dst[ch * plane_in + x] = a;
      }
    }
  }
  float* a = acc.data();
  for (int ch = 0; ch < C; ++ch) {
    const float* tm = tmp.data() + ch * plane_in;
    for (int y = 0; y < out_h; ++y) {
      std::fill(a, a + out_w, 0.f);
      const float* w = &ty.w[static_cast<size_t>(y) * ty.stride];
      for (int k = 0; k < ty.count[y]; ++k) {
        const float* r = tm + static_cast<size_t>(ty.first[y] + k - row0) * out_w;
        const float wk = w[k];
        for (int i = 0; i < out_w; ++i) a[i] += wk * r[i];
      }
      emit(ch, y, static_cast<const float*>(a));
    }
  }
}

}  // namespace

CropBox random_resized_crop_box(int width, int height, double scale_lo, double scale_hi, double ratio_lo, double ratio_hi,
                                SampleRng& rng) {
  const double area = static_cast<double>(width) * height;
  const double log_lo = std::log(ratio_lo), log_hi = std::log(ratio_hi);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * (scale_lo + (scale_hi - scale_lo) * rng.uniform());
    const double ratio = std::exp(log_lo + (log_hi - log_lo) * rng.uniform());
    const int w = static_cast<int>(std::lround(std::sqrt(target * ratio)));
    const int h = static_cast<int>(std::lround(std::sqrt(target / ratio)));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      const int y = static_cast<int>(rng.uniform_int(0, height - h + 1));
      const int x = static_cast<int>(rng.uniform_int(0, width - w + 1));
      return {double(x), double(y), double(w), double(h)};
    }
  }
  const double in_ratio = static_cast<double>(width) / height;
  int w = width, h = height;
  if (in_ratio < ratio_lo) {
    h = static_cast<int>(std::lround(w / ratio_lo));
  } else if (in_ratio > ratio_hi) {
    w = static_cast<int>(std::lround(h * ratio_hi));
  }
  return {double((width - w) / 2), double((height - h) / 2), double(w), double(h)};
}

CropBox resize_center_crop_box(int width, int height, int resize, int crop) {
  // torchvision Resize(int): the shorter side becomes `resize`, the longer int(resize * long / short).
  int rw, rh;
  if (width <= height) {
    rw = resize;
    rh = static_cast<int>(static_cast<int64_t>(resize) * height / width);
  } else {
    rh = resize;
    rw = static_cast<int>(static_cast<int64_t>(resize) * width / height);
  }
  const double fx = static_cast<double>(width) / rw, fy = static_cast<double>(height) / rh;
  // CenterCrop: top/left = round((resized - crop) / 2); a crop larger than the image is clamped here
  // (torchvision pads with zeros instead; resize >= crop, enforced by the config, avoids it).
  const int cw = std::min(crop, rw), ch = std::min(crop, rh);
  // Python 3 round() halves to even: std::nearbyint in the default rounding mode does the same.
  const double left = std::nearbyint((rw - cw) / 2.0), top = std::nearbyint((rh - ch) / 2.0);
  return {left * fx, top * fy, cw * fx, ch * fy};
}

CropBox whole_image_box(int width, int height) { return {0, 0, double(width), double(height)}; }

double min_decode_scale(const CropBox& box, int out_w, int out_h) {
  return std::min(1.0, std::max(out_w / box.w, out_h / box.h));
}

void resample_to_float(const Image& img, const CropBox& box, int out_w, int out_h, bool flip, const float* mean, const float* std,
                       float* out) {
  float mul[3], add[3];
  for (int c = 0; c < img.channels; ++c) {
    mul[c] = 1.f / (255.f * std[c]);
    add[c] = -mean[c] / std[c];
  }
  const size_t plane = static_cast<size_t>(out_w) * out_h;
  resample(img, box, out_w, out_h, [&](int c, int y, const float* v) {
    float* o = out + c * plane + static_cast<size_t>(y) * out_w;
    if (flip) {
      for (int x = 0; x < out_w; ++x) o[out_w - 1 - x] = v[x] * mul[c] + add[c];
    } else {
      for (int x = 0; x < out_w; ++x) o[x] = v[x] * mul[c] + add[c];
    }
  });
}

void resample_to_u8(const Image& img, const CropBox& box, int out_w, int out_h, uint8_t* out, bool flip) {
  const size_t plane = static_cast<size_t>(out_w) * out_h;
  resample(img, box, out_w, out_h, [&](int c, int y, const float* v) {
    uint8_t* o = out + c * plane + static_cast<size_t>(y) * out_w;
    for (int x = 0; x < out_w; ++x) o[x] = static_cast<uint8_t>(std::clamp(v[x] + 0.5f, 0.f, 255.f));
    if (flip) std::reverse(o, o + out_w);
  });
}

}  // namespace strobe::data
