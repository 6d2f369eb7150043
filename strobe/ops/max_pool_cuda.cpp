// CUDA glue of max_pool2d_fwd / _bwd (kernels in cuda/max_pool_kernels.cu): float32, bfloat16 or
// float16, channels-last NHWC (x's suggested memory format) or contiguous NCHW; an input in neither
// layout is made contiguous in its suggested format first.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda/max_pool.h"
#include "strobe/ops/cuda_glue.h"
#include "strobe/ops/max_pool.h"

namespace strobe::ops {
namespace {

using at::Tensor;
using cuda::DType;

DType to_pool_dtype(at::ScalarType s) { return detail::kernel_dtype(s, "max_pool2d (CUDA)", "x", detail::kFloatingTypes); }

cuda::PoolShape shape_of(at::IntArrayRef in, at::IntArrayRef out, const detail::PoolArgs& a, bool channels_last) {
  TORCH_CHECK(in[1] * in[2] * in[3] < (int64_t{1} << 31) && out[1] * out[2] * out[3] < (int64_t{1} << 31),
              "max_pool2d (CUDA): one image must hold fewer than 2^31 elements, got ", in);
  cuda::PoolShape s;
  s.n = in[0];
  s.c = static_cast<int>(in[1]), s.h = static_cast<int>(in[2]), s.w = static_cast<int>(in[3]);
  s.oh = static_cast<int>(out[2]), s.ow = static_cast<int>(out[3]);
  s.kh = static_cast<int>(a.kh), s.kw = static_cast<int>(a.kw), s.sh = static_cast<int>(a.sh);
  s.sw = static_cast<int>(a.sw), s.ph = static_cast<int>(a.ph), s.pw = static_cast<int>(a.pw);
  s.channels_last = channels_last;
  return s;
}

at::MemoryFormat format(bool channels_last) {
  return channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

std::tuple<Tensor, Tensor> mp_fwd_cuda(const Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                    at::IntArrayRef padding) {
  const detail::PoolArgs a = detail::pool_args(kernel_size, stride, padding);
  const auto sym = detail::pool_check(x, a);
  const DType dt = to_pool_dtype(x.scalar_type());
  const bool cl = detail::pool_channels_last(x);
  const std::vector<int64_t> out{x.size(0), x.size(1), sym[2].expect_int(), sym[3].expect_int()};
  const cuda::PoolShape s = shape_of(x.sizes(), out, a, cl);
  const c10::cuda::CUDAGuard guard(x.device());
  const Tensor xc = x.contiguous(format(cl));
  Tensor y = at::empty(out, x.options().memory_format(format(cl)));
  Tensor index = at::empty(out, x.options().dtype(at::kByte).memory_format(format(cl)));
  C10_CUDA_CHECK(cuda::max_pool_fwd(xc.data_ptr(), y.data_ptr(), index.data_ptr<uint8_t>(), dt, s,
                                    detail::current_stream()));
  return {y, index};
}

Tensor mp_bwd_cuda(const Tensor& grad_y, const Tensor& index, at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                at::IntArrayRef stride, at::IntArrayRef padding, bool channels_last) {
  const detail::PoolArgs a = detail::pool_args(kernel_size, stride, padding);
  TORCH_CHECK(input_size.size() == 4, "max_pool2d_bwd: input_size must be [N, C, H, W], got ", input_size);
  const std::vector<int64_t> out{input_size[0], input_size[1], (input_size[2] + 2 * a.ph - a.kh) / a.sh + 1,
                                 (input_size[3] + 2 * a.pw - a.kw) / a.sw + 1};
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef(out) && index.sizes() == at::IntArrayRef(out) &&
                  index.scalar_type() == at::kByte,
              "max_pool2d_bwd: grad_y and the uint8 index must be ", at::IntArrayRef(out), ", got ", grad_y.sizes(),
              " and ", index.sizes(), " ", index.scalar_type());
  TORCH_CHECK(grad_y.device() == index.device(), "max_pool2d_bwd: grad_y and index must be on one device");
  const DType dt = to_pool_dtype(grad_y.scalar_type());
  const cuda::PoolShape s = shape_of(input_size, out, a, channels_last);
  const c10::cuda::CUDAGuard guard(grad_y.device());
  // (the incoming gradient may be in another layout, e.g. from a flatten; the index never is)
  const Tensor gy = grad_y.contiguous(format(channels_last)), ic = index.contiguous(format(channels_last));
  Tensor gx = at::empty(input_size, grad_y.options().memory_format(format(channels_last)));
  C10_CUDA_CHECK(cuda::max_pool_bwd(gy.data_ptr(), ic.data_ptr<uint8_t>(), gx.data_ptr(), dt, s,
                                    detail::current_stream()));
  return gx;
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("max_pool2d_fwd", &strobe::ops::mp_fwd_cuda);
  m.impl("max_pool2d_bwd", &strobe::ops::mp_bwd_cuda);
}
