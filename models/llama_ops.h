// The operations of the llama model (models/llama.cpp), in one place: RMSNorm, the rotary tables and
// their application and the SwiGLU MLP (grouped-query K/V go to models/attention.h as they are).
// Each is written with ATen ops in the numerics of Hugging Face's LlamaForCausalLM (fp32 RMS
// statistics, fp32 rotary angles in HF's order), so its weights give its logits. This is the seam where fused kernels replace them: the
// model calls nothing else for these steps.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/ATen.h>

namespace strobe::models::llama_ops {

// Llama-3's rope_scaling (rope_type llama3): long wavelengths divided by `factor`, short ones kept,
// the band between interpolated (HF's _compute_llama3_parameters).
struct Llama3RopeScaling {
  double factor = 32.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// weight * (x / sqrt(mean(x^2) + eps)), the statistics and the scaling in fp32, the product with the
// weight in x's dtype (HF: `weight * hidden.to(input_dtype)`).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// inv_freq[i] = 1 / theta^(2i / head_dim) in fp32 (then rescaled by `scaling`), [head_dim / 2].
at::Tensor rope_inv_freq(int64_t head_dim, double theta, const std::optional<Llama3RopeScaling>& scaling,
                         const at::Device& device);

// cos and sin of positions * inv_freq, duplicated over both halves of a head ([..., head_dim], fp32):
// positions of any shape ([B, S] or [T]) give [B, S, head_dim] or [T, head_dim].
std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, const at::Tensor& inv_freq);

// x * cos + rotate_half(x) * sin for x [..., H, D] (cos/sin [..., D], broadcast over the heads and
// cast to x's dtype): HF's rotate-half convention, on the two halves of each head.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// down(silu(gate(x)) * up(x)), bias-free.
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& gate_weight, const at::Tensor& up_weight,
                  const at::Tensor& down_weight);

}  // namespace strobe::models::llama_ops
