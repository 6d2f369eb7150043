// Float8 training (trainer.fp8, docs/CONFIG.md "Float8 training"): which linear layers run their
// GEMMs in float8, and the one call every model's linear layer goes through.
//
// A model declares the linear layers it can run in float8 (Model::fp8_layers: globs over module
// paths; llama's decoder layers, vit's and decoder_lm's blocks) and runs each through
// strobe::linear(layer, x). The trainer selects among them (select_fp8_layers: trainer.fp8's skip
// globs, min_size, the float8 GEMM's multiple-of-16 rule) and marks the chosen ones for its life
// (Fp8Layers); strobe::linear runs a marked layer through strobe::ops::fp8_linear and any other
// through at::linear.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "strobe/config/experiment.h"
#include "strobe/config/precision.h"

namespace strobe {

// y = x W^T + b for an nn::Linear, x of any rank: strobe::ops::fp8_linear when a trainer has marked
// the layer (under autocast, x is first cast to the autocast dtype, as at::linear would), at::linear
// otherwise (its bias in the GEMM's epilogue: one addmm for a contiguous [..., C] input). x_amax: max
// |x| from x's producer (add_layer_norm_amax's), for the float8 path.
at::Tensor linear(const torch::nn::Linear& layer, const at::Tensor& x, const std::optional<at::Tensor>& x_amax = std::nullopt);
// y = x weight^T + b through strobe::ops::fp8_linear, under autocast with x (and b) first cast to the
// autocast dtype as at::linear would (the float8 casts read an fp32 weight directly). x_amax: max |x|
// from x's producer (linear_swiglu_in_fp8's), used when x is not cast.
at::Tensor linear_in_fp8(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias = std::nullopt,
                         const std::optional<at::Tensor>& x_amax = std::nullopt);
// (swiglu(x weight^T), its max |.|) through strobe::ops::fp8_linear_swiglu (weight [2 x F, C]: gate rows,
// then up rows), under autocast with x first cast as linear_in_fp8 does: the amax goes to the float8
// linear that reads the output, so its cast makes one pass over it. x_amax: max |x| from x's producer.
std::tuple<at::Tensor, at::Tensor> linear_swiglu_in_fp8(const at::Tensor& x, const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& x_amax = std::nullopt);
// Whether a trainer has marked `layer` for float8.
bool fp8_marked(const torch::nn::Module& layer);

// One float8-capable linear layer of a model and the selection's verdict.
struct Fp8Choice {
  std::string path;  // its module path: "layers.3.mlp.down_proj"
  const torch::nn::Module* layer = nullptr;
  int64_t out_features = 0, in_features = 0;
  bool fp8 = false;
  std::string why_not;  // when !fp8: "skip", "below min_size", "not a multiple of 16"
};

// The model's float8-capable nn::Linear layers (those whose path matches one of `capable`, the
// model's Model::fp8_layers) with trainer.fp8's verdict for each. ConfigError (one line) when a skip
// glob matches no capable layer, when the model declares none, or when none is chosen.
std::vector<Fp8Choice> select_fp8_layers(const torch::nn::Module& net, const std::vector<std::string>& capable,
                                         const config::Fp8Config& cfg, const std::string& model_name);

// Whether float8 GEMMs run under `precision` (bf16-master, bf16-mixed).
bool fp8_runs_under(Precision precision);
// trainer.fp8's checks of the run, before anything trains: a precision it works under (bf16-master,
// bf16-mixed) and a device with float8 GEMMs (the CPU, through ATen's; a GPU of compute capability 8.9
// or 9.0+). ConfigError naming what is wrong.
void check_fp8_run(Precision precision, const torch::Device& device);
// The refusal of a GPU of compute capability major.minor ("" when it has float8 GEMMs: 8.9 or more).
std::string fp8_device_refusal(const std::string& device, const std::string& name, int major, int minor);

// The chosen layers marked for strobe::linear while this lives (the trainer holds one).
class Fp8Layers {
 public:
  Fp8Layers(const torch::nn::Module& net, std::vector<Fp8Choice> choices);
  ~Fp8Layers();
  Fp8Layers(const Fp8Layers&) = delete;
  Fp8Layers& operator=(const Fp8Layers&) = delete;
  const std::vector<Fp8Choice>& choices() const { return choices_; }
  // "64 of 112 linear layers in float8: layers.*.self_attn.{q,o}_proj ...": one line for the run's
  // start, the layers grouped by their path with block indices as `*`.
  std::string summary() const;
  // The table for model_summary.txt: every capable layer, its shape and float8 or why not.
  std::string table() const;

 private:
  const torch::nn::Module* net_;
  std::vector<Fp8Choice> choices_;
};

// The live selection of the model `net` (a trainer's), for model_summary; nullptr when none.
const Fp8Layers* fp8_layers_of(const torch::nn::Module& net);

}  // namespace strobe
