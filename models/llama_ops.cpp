#include "models/llama_ops.h"

#include <cmath>

namespace strobe::models::llama_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto xf = x.to(at::kFloat);
  const auto variance = xf.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (xf * at::rsqrt(variance + eps)).to(x.scalar_type());
}

at::Tensor rope_inv_freq(int64_t head_dim, double theta, const std::optional<Llama3RopeScaling>& scaling,
                         const at::Device& device) {
  const auto opts = at::TensorOptions().device(device);
  // HF: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)); `1.0 / t` is
  // t.reciprocal() * 1.0 in PyTorch, and so is every `scalar / tensor` below.
  const auto exponent = at::arange(0, head_dim, 2, opts.dtype(at::kLong)).to(at::kFloat) / static_cast<double>(head_dim);
  auto inv_freq = at::pow(theta, exponent).reciprocal();
  if (!scaling) return inv_freq;
  const auto& s = *scaling;
  const double old_len = static_cast<double>(s.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / s.low_freq_factor, high_freq_wavelen = old_len / s.high_freq_factor;
  const auto wavelen = inv_freq.reciprocal() * (2 * M_PI);
  auto scaled = at::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  const auto smooth = (wavelen.reciprocal() * old_len - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  const auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  const auto medium = (wavelen < high_freq_wavelen).logical_not() * (wavelen > low_freq_wavelen).logical_not();
  return at::where(medium, smoothed, scaled);
}

std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, const at::Tensor& inv_freq) {
  // HF: inv_freq @ positions in fp32 with autocast off: one product per entry, as here.
  const auto freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq.to(at::kFloat);
  const auto emb = at::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto c = cos.unsqueeze(-2).to(x.scalar_type()), s = sin.unsqueeze(-2).to(x.scalar_type());
  const int64_t half = x.size(-1) / 2;
  const auto rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rotated * s;
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& gate_weight, const at::Tensor& up_weight,
                  const at::Tensor& down_weight) {
  return at::linear(at::silu(at::linear(x, gate_weight)) * at::linear(x, up_weight), down_weight);
}

}  // namespace strobe::models::llama_ops
