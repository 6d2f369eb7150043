// Model: a network built from the `model:` config section. forward() takes the whole batch so each
// model reads the inputs it needs ("image", "tokens" + "cu_seqlens"/"position_ids", ...).
#pragma once

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "strobe/config/precision.h"
#include "strobe/config/registry.h"
#include "strobe/data/batch.h"

namespace strobe {

class Model : public torch::nn::Module {
 public:
  explicit Model(const std::string& name) : torch::nn::Module(name) {}
  virtual torch::Tensor forward(const Batch& batch) = 0;
  // The task a model trains with when `task:` names none (e.g. resnet -> classification).
  virtual std::string default_task() const = 0;
  // The batch keys forward() reads ({"tokens"}, {"image"}); empty: not declared. A run whose data
  // declares its keys (DataInfo::batch_keys) and lacks one of these is refused before it starts.
  virtual std::vector<std::string> batch_keys() const { return {}; }
  // The training FLOPs (forward and backward) of one batch by the model's own count, from host-known
  // shapes and facts only (never a device read): the throughput monitor's and `strobe bench`'s model
  // FLOP/s and utilisation (docs/CONFIG.md, "throughput_monitor"). 0: not declared; the monitor then
  // reports samples and tokens per second without FLOP/s.
  virtual double training_flops(const Batch& /*batch*/) const { return 0; }
  // Parameters that take no weight decay under `optimizer.param_groups.no_decay: auto` besides those
  // with at most one dimension (timm's no_weight_decay(): vit's pos_embed and cls_token).
  virtual std::vector<std::string> no_weight_decay() const { return {}; }
  // The model's depth order for layer-wise learning-rate decay (`optimizer.param_groups.layer_decay`,
  // timm's param_groups_layer_decay): layers 0 (the embeddings) to num_layers() - 1 (the head), and
  // the layer of each parameter. 0 layers: not declared (the key is then refused naming the model).
  virtual int64_t num_layers() const { return 0; }
  virtual int64_t layer_of(const std::string& /*param*/) const { return num_layers() - 1; }
  // The linear layers that can run their GEMMs in float8 under trainer.fp8 (strobe/core/fp8.h): globs
  // over module paths ("layers.*"). The model runs every nn::Linear those match through
  // strobe::linear(layer, x), so a layer the trainer marks takes the float8 path. Empty: none.
  virtual std::vector<std::string> fp8_layers() const { return {}; }
  // trainer.strategy fsdp (docs/DISTRIBUTED.md, "fsdp"): the modules that are units of their own,
  // globs over module paths as optimizer.param_groups' ("layers.*": every decoder layer; a module
  // inside one already matched belongs to it). Each must run through run_block (models/layers.h),
  // which gathers its unit around it. The parameters of no unit (a tied embedding and head, the
  // final norm) form one more unit that stays gathered. An embedding that is a unit (an
  // nn::Embedding) is not gathered for its backward (its gradient needs the indices only); the last
  // unit is kept from its forward to its backward. Empty: the model cannot train under fsdp
  // (refused, naming it).
  virtual std::vector<std::string> fsdp_units() const { return {}; }
  // Called once the trainer has moved the model to its device, before the optimizer sees the
  // parameters (and before bf16-master converts them, except under zero2 with several processes,
  // whose host-side build moves them to the device in bf16 first: docs/DISTRIBUTED.md, "Building
  // the model under zero2"): a model may change their memory layout there
  // (resnet: channels_last on CUDA under a reduced precision). `precision` is trainer.precision
  // (strobe/config/precision.h).
  virtual void on_device(const torch::Device& /*device*/, Precision /*precision*/) {}
  // The language-model head's input, for a loss that never builds the logits (language_modeling's
  // `fused_linear_loss`, ops::linear_cross_entropy): forward(batch) == linear(hidden, weight, bias).
  // Models with such a head (llama, decoder_lm) override both; the others have none (0).
  struct HeadInput {
    torch::Tensor hidden;  // [..., C]
    torch::Tensor weight;  // [V, C] (a tied head: the embedding's own weight)
    std::optional<torch::Tensor> bias;
    // The module holding weight and bias when it is the head's own (an untied head): run the head
    // through run_in_unit(*module, ...) (strobe/core/activation_checkpoint.h), which gathers it
    // under trainer.strategy fsdp. Null for a tied head (the embedding's weight, kept gathered).
    torch::nn::Module* module = nullptr;
  };
  // The head's output size (the vocabulary) when the model has such a head, else 0.
  virtual int64_t head_input_vocab() const { return 0; }
  virtual HeadInput forward_head_input(const Batch& /*batch*/) {
    throw std::logic_error(name() + " has no language-model head to hand to a fused loss");
  }
  // precision bf16-master: floating inputs are cast to the weights' dtype at the model's entry
  // (models call input() on what they read from the batch). Unset: inputs are used as given.
  void set_input_dtype(std::optional<c10::ScalarType> dtype) { input_dtype_ = dtype; }
  torch::Tensor input(const torch::Tensor& x) const {
    return input_dtype_ && x.is_floating_point() && x.scalar_type() != *input_dtype_ ? x.to(*input_dtype_) : x;
  }

 private:
  std::optional<c10::ScalarType> input_dtype_;
};

// The index i of a parameter named "<list>.<i>.<...>" (blocks.3.mlp.fc1.weight -> 3), else -1: for
// layer_of() over a ModuleList of blocks.
int64_t list_index(const std::string& param, const std::string& list);

using ModelRegistry = Registry<std::shared_ptr<Model>>;
ModelRegistry& model_registry();

}  // namespace strobe
