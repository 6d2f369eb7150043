// Small layer helpers shared by the built-in models.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

namespace strobe::models {

// y = x W^T + b through ATen's at::linear, for x of any rank.
// nn::Linear's own forward (torch::nn::functional::linear in the C++ frontend) runs `matmul` and then
// a broadcast `output += bias` whenever x has more than 2 dims: one more strided pass over every
// output (a legacy TensorIterator kernel: 15.6 ms of a ViT-L step and 19.5 ms of a padded LM step on
// an H200, bench/e2e/profile_gpu.sh). at::linear folds a contiguous [..., C] input into one addmm
// whose bias add happens in the GEMM's epilogue. Same parameters, same checkpoint names.
inline at::Tensor linear(const torch::nn::Linear& layer, const at::Tensor& x) {
  return at::linear(x, layer->weight, layer->bias.defined() ? std::optional<at::Tensor>(layer->bias) : std::nullopt);
}

}  // namespace strobe::models
