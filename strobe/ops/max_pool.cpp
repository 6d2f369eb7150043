// max_pool2d: 2-D max-pooling with a one-byte argmax (docs/OPS.md). Argument checks shared by every
// device, the CPU implementation (plain loops, the same algorithm as the CUDA kernels: it is their
// tests' reference and the models' `custom_pool: true` path on CPU), the Meta kernels, autograd and
// the C++ wrapper. CUDA kernels: cuda/max_pool_kernels.cu, glue: max_pool_cuda.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "strobe/ops/max_pool.h"
#include "strobe/ops/ops.h"

namespace strobe::ops {
namespace detail {

PoolArgs pool_args(at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding) {
  TORCH_CHECK(kernel_size.size() == 1 || kernel_size.size() == 2,
              "max_pool2d: kernel_size must be one int or two, got ", kernel_size);
  TORCH_CHECK(stride.empty() || stride.size() == 1 || stride.size() == 2,
              "max_pool2d: stride must be empty (= kernel_size), one int or two, got ", stride);
  TORCH_CHECK(padding.size() == 1 || padding.size() == 2, "max_pool2d: padding must be one int or two, got ",
              padding);
  PoolArgs a;
  a.kh = kernel_size[0], a.kw = kernel_size.back();
  const at::IntArrayRef st = stride.empty() ? kernel_size : stride;
  a.sh = st[0], a.sw = st.back();
  a.ph = padding[0], a.pw = padding.back();
  TORCH_CHECK(a.kh > 0 && a.kw > 0, "max_pool2d: kernel_size must be positive, got ", kernel_size);
  TORCH_CHECK(a.kh * a.kw <= 256, "max_pool2d: the window may hold at most 256 elements (one-byte argmax), got ",
              a.kh, "x", a.kw);
  TORCH_CHECK(a.sh > 0 && a.sw > 0, "max_pool2d: stride must be positive, got ", st);
  TORCH_CHECK(a.ph >= 0 && a.pw >= 0 && a.ph <= a.kh / 2 && a.pw <= a.kw / 2,
              "max_pool2d: padding must be between 0 and half the kernel size, got padding ", padding,
              " for kernel_size ", kernel_size);
  return a;
}

std::vector<c10::SymInt> pool_check(const at::Tensor& x, const PoolArgs& a) {
  TORCH_CHECK(x.defined(), "max_pool2d: x must be defined");
  TORCH_CHECK(x.dim() == 4, "max_pool2d: x must be [N, C, H, W], got ", x.sym_sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "max_pool2d: x must be floating point, got ", x.scalar_type());
  const c10::SymInt h = x.sym_size(2), w = x.sym_size(3);
  TORCH_CHECK(h + 2 * a.ph >= a.kh && w + 2 * a.pw >= a.kw, "max_pool2d: the padded input ", x.sym_sizes(),
              " (padding ", a.ph, ", ", a.pw, ") is smaller than the kernel ", a.kh, "x", a.kw);
  return {x.sym_size(0), x.sym_size(1), (h + 2 * a.ph - a.kh) / a.sh + 1, (w + 2 * a.pw - a.kw) / a.sw + 1};
}

bool pool_channels_last(const at::Tensor& x) {
  return x.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
}

}  // namespace detail

namespace {

using at::Tensor;
using detail::PoolArgs;

// Position of the maximum of each window, ATen's rule (aten/src/ATen/native/cpu/MaxPoolKernel.cpp):
// start at the first in-image element with -inf, take `val > max || isnan(val)`.
template <typename T>
void fwd_planes(const T* x, T* y, uint8_t* index, int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                const PoolArgs& a) {
  using acc_t = at::opmath_type<T>;
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const T* src = x + p * h * w;
      for (int64_t i = 0; i < oh; ++i) {
        for (int64_t j = 0; j < ow; ++j) {
          const int64_t h0 = i * a.sh - a.ph, w0 = j * a.sw - a.pw;
          const int64_t ya = std::max<int64_t>(h0, 0), yb = std::min(h0 + a.kh, h);
          const int64_t xa = std::max<int64_t>(w0, 0), xb = std::min(w0 + a.kw, w);
          acc_t best = -std::numeric_limits<acc_t>::infinity();
          int64_t arg = (ya - h0) * a.kw + (xa - w0);
          for (int64_t yy = ya; yy < yb; ++yy) {
            for (int64_t xx = xa; xx < xb; ++xx) {
              const acc_t v = static_cast<acc_t>(src[yy * w + xx]);
              if (v > best || std::isnan(v)) best = v, arg = (yy - h0) * a.kw + (xx - w0);
            }
          }
          const int64_t o = (p * oh + i) * ow + j;
          y[o] = static_cast<T>(best);
          index[o] = static_cast<uint8_t>(arg);
        }
      }
    }
  });
}

// The gather of the CUDA kernels: each input element sums, in row-major output order (the order of
// ATen's scatter), the gradients of the outputs whose window chose it.
template <typename T>
void bwd_planes(const T* gy, const uint8_t* index, T* gx, int64_t planes, int64_t h, int64_t w, int64_t oh,
                int64_t ow, const PoolArgs& a) {
  using acc_t = at::opmath_type<T>;
  auto covering = [](int64_t i, int64_t k, int64_t s, int64_t p, int64_t outs, int64_t& lo, int64_t& hi) {
    const int64_t first = i + p - k + 1;
    lo = first <= 0 ? 0 : (first + s - 1) / s;
    hi = std::min((i + p) / s, outs - 1);
  };
  at::parallel_for(0, planes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t iy = 0; iy < h; ++iy) {
        int64_t oh0, oh1;
        covering(iy, a.kh, a.sh, a.ph, oh, oh0, oh1);
        for (int64_t ix = 0; ix < w; ++ix) {
          int64_t ow0, ow1;
          covering(ix, a.kw, a.sw, a.pw, ow, ow0, ow1);
          acc_t acc = 0;
          for (int64_t i = oh0; i <= oh1; ++i) {
            for (int64_t j = ow0; j <= ow1; ++j) {
              const int64_t o = (p * oh + i) * ow + j;
              if (index[o] == (iy - (i * a.sh - a.ph)) * a.kw + (ix - (j * a.sw - a.pw))) acc += static_cast<acc_t>(gy[o]);
            }
          }
          gx[(p * h + iy) * w + ix] = static_cast<T>(acc);
        }
      }
    }
  });
}

std::tuple<Tensor, Tensor> mp_fwd_cpu(const Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                   at::IntArrayRef padding) {
  const PoolArgs a = detail::pool_args(kernel_size, stride, padding);
  const auto shape = detail::pool_check(x, a);
  const auto fmt = detail::pool_channels_last(x) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const Tensor xc = x.contiguous();
  const std::vector<int64_t> out{x.size(0), x.size(1), shape[2].expect_int(), shape[3].expect_int()};
  Tensor y = at::empty(out, x.options()), index = at::empty(out, x.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "max_pool2d_fwd_cpu", [&] {
    fwd_planes<scalar_t>(xc.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(),
                         index.mutable_data_ptr<uint8_t>(), x.size(0) * x.size(1), x.size(2), x.size(3), out[2],
                         out[3], a);
  });
  return {y.contiguous(fmt), index.contiguous(fmt)};
}

void bwd_check(const Tensor& grad_y, const Tensor& index, at::IntArrayRef input_size, const PoolArgs& a) {
  TORCH_CHECK(input_size.size() == 4, "max_pool2d_bwd: input_size must be [N, C, H, W], got ", input_size);
  const int64_t oh = (input_size[2] + 2 * a.ph - a.kh) / a.sh + 1, ow = (input_size[3] + 2 * a.pw - a.kw) / a.sw + 1;
  const std::vector<int64_t> out{input_size[0], input_size[1], oh, ow};
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef(out) && index.sizes() == at::IntArrayRef(out) &&
                  index.scalar_type() == at::kByte && at::isFloatingType(grad_y.scalar_type()),
              "max_pool2d_bwd: grad_y (floating) and the uint8 index must be ", at::IntArrayRef(out), ", got ",
              grad_y.sizes(), " ", grad_y.scalar_type(), " and ", index.sizes(), " ", index.scalar_type());
  TORCH_CHECK(grad_y.device() == index.device(), "max_pool2d_bwd: grad_y and index must be on one device");
}

Tensor mp_bwd_cpu(const Tensor& grad_y, const Tensor& index, at::IntArrayRef input_size, at::IntArrayRef kernel_size,
               at::IntArrayRef stride, at::IntArrayRef padding, bool channels_last) {
  const PoolArgs a = detail::pool_args(kernel_size, stride, padding);
  bwd_check(grad_y, index, input_size, a);
  const Tensor gy = grad_y.contiguous(), ic = index.contiguous();
  Tensor gx = at::empty(input_size, grad_y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_y.scalar_type(), "max_pool2d_bwd_cpu", [&] {
    bwd_planes<scalar_t>(gy.const_data_ptr<scalar_t>(), ic.const_data_ptr<uint8_t>(), gx.mutable_data_ptr<scalar_t>(),
                         input_size[0] * input_size[1], input_size[2], input_size[3], gy.size(2), gy.size(3), a);
  });
  return channels_last ? gx.contiguous(at::MemoryFormat::ChannelsLast) : gx;
}

std::tuple<Tensor, Tensor> mp_fwd_meta(const Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                    at::IntArrayRef padding) {
  const PoolArgs a = detail::pool_args(kernel_size, stride, padding);
  const auto shape = detail::pool_check(x, a);
  const auto fmt = detail::pool_channels_last(x) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  return {at::empty_symint(shape, x.options(), fmt), at::empty_symint(shape, x.options().dtype(at::kByte), fmt)};
}

Tensor mp_bwd_meta(const Tensor& grad_y, const Tensor& index, c10::SymIntArrayRef input_size,
                at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding, bool channels_last) {
  (void)index;
  detail::pool_args(kernel_size, stride, padding);
  return at::empty_symint(input_size, grad_y.options(),
                          channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
}

using MpFwdSig = std::tuple<Tensor, Tensor>(const Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef);
using MpBwdSig = Tensor(const Tensor&, const Tensor&, c10::SymIntArrayRef, at::IntArrayRef, at::IntArrayRef,
                      at::IntArrayRef, bool);

const c10::TypedOperatorHandle<MpFwdSig>& mp_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::max_pool2d_fwd", "").typed<MpFwdSig>();
  return op;
}
const c10::TypedOperatorHandle<MpBwdSig>& mp_bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("strobe::max_pool2d_bwd", "").typed<MpBwdSig>();
  return op;
}

// dilation 1 and ceil_mode false only: the arguments exist for signature parity with
// torch.nn.functional.max_pool2d, so a model passing them gets a clear error instead of other results.
void check_unsupported(at::IntArrayRef dilation, bool ceil_mode) {
  for (int64_t d : dilation) TORCH_CHECK(d == 1, "max_pool2d: only dilation 1 is supported, got ", dilation);
  TORCH_CHECK(!ceil_mode, "max_pool2d: ceil_mode=True is not supported (floor only)");
}

class MaxPoolFunction : public torch::autograd::Function<MaxPoolFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, at::IntArrayRef kernel_size,
                        at::IntArrayRef stride, at::IntArrayRef padding) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, index] = mp_fwd_op().call(x, kernel_size, stride, padding);
    // Only the one-byte index and the input's shape are kept, never x.
    ctx->save_for_backward({index});
    ctx->saved_data["input_size"] = x.sym_sizes().vec();
    ctx->saved_data["kernel_size"] = kernel_size.vec();
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["channels_last"] = detail::pool_channels_last(x);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const Tensor& go = grad_outputs[0];
    if (!go.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const auto saved = ctx->get_saved_variables();
    const auto input_size = ctx->saved_data["input_size"].toSymIntVector();
    const auto k = ctx->saved_data["kernel_size"].toIntVector(), s = ctx->saved_data["stride"].toIntVector(),
               p = ctx->saved_data["padding"].toIntVector();
    Tensor gx = mp_bwd_op().call(go, saved[0], input_size, k, s, p, ctx->saved_data["channels_last"].toBool());
    return {gx, Tensor(), Tensor(), Tensor()};
  }
};

Tensor max_pool_autograd(const Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                         at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  check_unsupported(dilation, ceil_mode);
  return MaxPoolFunction::apply(x, kernel_size, stride, padding);
}

Tensor max_pool_nograd(const Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,
                       at::IntArrayRef dilation, bool ceil_mode) {
  check_unsupported(dilation, ceil_mode);
  return std::get<0>(mp_fwd_op().call(x, kernel_size, stride, padding));
}

}  // namespace

Tensor max_pool2d(const Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,
                  at::IntArrayRef dilation, bool ceil_mode) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::max_pool2d", "")
          .typed<Tensor(const Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, bool)>();
  return op.call(x, kernel_size, stride, padding, dilation, ceil_mode);
}

bool max_pool2d_cuda_eligible(const Tensor& x) {
  if (!built_with_cuda() || !x.is_cuda() || x.dim() != 4) return false;
  const auto dt = x.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) return false;
  // no hidden copy: the kernels read contiguous NCHW or channels-last NHWC as they are
  return x.is_contiguous() || x.is_contiguous(at::MemoryFormat::ChannelsLast);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) { m.impl("max_pool2d", &strobe::ops::max_pool_autograd); }
TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("max_pool2d", &strobe::ops::max_pool_nograd);
  m.impl("max_pool2d_fwd", &strobe::ops::mp_fwd_cpu);
  m.impl("max_pool2d_bwd", &strobe::ops::mp_bwd_cpu);
}
TORCH_LIBRARY_IMPL(strobe, CUDA, m) { m.impl("max_pool2d", &strobe::ops::max_pool_nograd); }
TORCH_LIBRARY_IMPL(strobe, Meta, m) {
  m.impl("max_pool2d", &strobe::ops::max_pool_nograd);
  m.impl("max_pool2d_fwd", &strobe::ops::mp_fwd_meta);
  m.impl("max_pool2d_bwd", &strobe::ops::mp_bwd_meta);
}
