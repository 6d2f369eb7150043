// CUDA glue of conv3x3_maxpool_relu_fwd / _bwd (kernels in cuda/conv_pool_kernels.cu).
#include <ATen/ATen.h>
#include <string>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "strobe/ops/cuda/conv_pool.h"
#include "strobe/ops/cuda_glue.h"

namespace strobe::ops {
namespace detail {
void conv_pool_check_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
}  // namespace detail

namespace {

using at::Tensor;
using cuda::DType;

// x may also be uint8 (raw pixels, scaled by input_scale); everything else is floating.
DType to_cp_dtype(at::ScalarType s, const char* what) {
  constexpr const char* op = "conv3x3_maxpool_relu (CUDA)";
  if (std::string(what) == "x")
    return detail::kernel_dtype(s, op, what, {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kUInt8});
  return detail::kernel_dtype(s, op, what, detail::kFloatingTypes);
}

cuda::ConvPoolShape shape_of(const Tensor& x, const Tensor& weight) {
  TORCH_CHECK(x.size(0) <= 65535, "conv3x3_maxpool_relu (CUDA): batch must be <= 65535, got ",
              x.size(0));
  TORCH_CHECK(x.size(1) <= 64, "conv3x3_maxpool_relu (CUDA): at most 64 input channels, got ",
              x.size(1));
  TORCH_CHECK(x.size(2) < (1 << 30) && x.size(3) < (1 << 30) && x.size(2) * x.size(3) < (1LL << 31),
              "conv3x3_maxpool_relu (CUDA): image too large ", x.sizes());
  cuda::ConvPoolShape s;
  s.n = x.size(0);
  s.cin = static_cast<int>(x.size(1));
  s.cout = static_cast<int>(weight.size(0));
  s.h = static_cast<int>(x.size(2));
  s.w = static_cast<int>(x.size(3));
  return s;
}

std::tuple<Tensor, Tensor> cp_fwd_cuda(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                    double input_scale, at::ScalarType out_dtype) {
  detail::conv_pool_check_inputs(x, weight, bias);
  const DType xdt = to_cp_dtype(x.scalar_type(), "x");
  const DType ydt = to_cp_dtype(out_dtype, "out_dtype");
  const cuda::ConvPoolShape s = shape_of(x, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  const Tensor xc = x.contiguous();
  const Tensor wc = weight.to(at::kFloat).contiguous(), bc = bias.to(at::kFloat).contiguous();
  const std::vector<int64_t> shape{s.n, s.cout, s.h / 2, s.w / 2};
  Tensor y = at::empty(shape, x.options().dtype(out_dtype));
  Tensor mask = at::empty(shape, x.options().dtype(at::kByte));
  C10_CUDA_CHECK(cuda::conv_pool_fwd(xc.data_ptr(), xdt, static_cast<float>(input_scale),
                                     wc.data_ptr<float>(), bc.data_ptr<float>(), y.data_ptr(), ydt,
                                     mask.data_ptr<uint8_t>(), s, detail::current_stream()));
  return {y, mask};
}

std::tuple<Tensor, Tensor, Tensor> cp_bwd_cuda(const Tensor& grad_y, const Tensor& x,
                                            const Tensor& weight, const Tensor& mask,
                                            double input_scale, bool input_grad) {
  const cuda::ConvPoolShape s = shape_of(x, weight);
  const std::vector<int64_t> shape{s.n, s.cout, s.h / 2, s.w / 2};
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef(shape) && mask.sizes() == at::IntArrayRef(shape) &&
                  mask.scalar_type() == at::kByte,
              "conv3x3_maxpool_relu_bwd: grad_y and the uint8 mask must be ", at::IntArrayRef(shape));
  TORCH_CHECK(grad_y.device() == x.device() && mask.device() == x.device() &&
                  weight.device() == x.device(),
              "conv3x3_maxpool_relu_bwd: all tensors must be on one device");
  TORCH_CHECK(!input_grad || at::isFloatingType(x.scalar_type()),
              "conv3x3_maxpool_relu_bwd: no input gradient for integer x");
  const DType gydt = to_cp_dtype(grad_y.scalar_type(), "grad_y");
  const DType xdt = to_cp_dtype(x.scalar_type(), "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = detail::current_stream();
  const Tensor gy = grad_y.contiguous(), mc = mask.contiguous(), xc = x.contiguous();
  const Tensor wc = weight.to(at::kFloat).contiguous();
  const auto fopt = x.options().dtype(at::kFloat);
  Tensor gx;
  if (input_grad) {
    gx = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    C10_CUDA_CHECK(cuda::conv_pool_bwd_input(gy.data_ptr(), gydt, mc.data_ptr<uint8_t>(),
                                             wc.data_ptr<float>(), static_cast<float>(input_scale),
                                             gx.data_ptr(), xdt, s, stream));
  }
  Tensor gw = at::empty({s.cout, s.cin, 3, 3}, fopt), gb = at::empty({s.cout}, fopt);
  Tensor ws = at::empty({std::max<int64_t>(1, cuda::conv_pool_wgrad_workspace(s))}, fopt);
  C10_CUDA_CHECK(cuda::conv_pool_bwd_weight(gy.data_ptr(), gydt, mc.data_ptr<uint8_t>(),
                                            xc.data_ptr(), xdt, static_cast<float>(input_scale),
                                            ws.data_ptr<float>(), gw.data_ptr<float>(),
                                            gb.data_ptr<float>(), s, stream));
  return {gx, gw.to(weight.scalar_type()), gb.to(weight.scalar_type())};
}

}  // namespace
}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("conv3x3_maxpool_relu_fwd", &strobe::ops::cp_fwd_cuda);
  m.impl("conv3x3_maxpool_relu_bwd", &strobe::ops::cp_bwd_cuda);
}
