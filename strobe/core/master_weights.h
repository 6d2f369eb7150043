// precision: bf16-master — bf16 weights and activations for the forward and backward, fp32 master
// weights in the optimizer (the scheme of Megatron-LM and Apex's O2).
//
// Under bf16-mixed (autocast) every forward re-casts fp32 weights and the fp32 outputs of the ops
// autocast keeps in fp32 (LayerNorm, the residual stream) to bf16 and back; in PyTorch eager that is
// ~9% of a ViT-L/16 step and ~10% of the decoder LM's (H200, bench/levers/levers.py). Here the model's
// parameters and floating buffers are bf16 (so activations are too, with no casts), BatchNorm layers
// excepted (cuDNN takes bf16 activations with fp32 affine parameters and statistics), and the
// optimizer updates fp32 copies:
//   attach_grads()   before optimizer.step(): each master's gradient is its bf16 parameter's
//                    (our fused optimizers read bf16 gradients; torch::optim gets an fp32 copy)
//   copy_to_model()  after it: the bf16 parameters = the masters rounded (one multi-tensor copy; a
//                    skipped step leaves the masters, and so the parameters, as they were)
// Checkpoints hold the fp32 masters under the model's parameter names, so a checkpoint of a
// bf16-master run loads into a "32" or bf16-mixed run and back.
#pragma once

#include <optional>
#include <unordered_map>
#include <vector>

#include <torch/types.h>

namespace torch::nn {
class Module;
}

namespace strobe {

// A BatchNorm1d/2d/3d layer (kept in fp32 under bf16-master; optimizer.param_groups.freeze's train_bn).
bool is_batch_norm(torch::nn::Module& m);

class MasterWeights {
 public:
  // Converts `net` in place (call after it is on its device, before the optimizer is built).
  explicit MasterWeights(torch::nn::Module& net, c10::ScalarType dtype = c10::kBFloat16);
  // The host-side build (trainer.strategy zero2 with several processes, docs/DISTRIBUTED.md): `net`
  // is on the host; each converted parameter and floating buffer moves to `device` in `dtype` one at
  // a time, and its fp32 master stays on the host (the parameter's own fp32 storage, not a copy), for
  // the strategy to cut this rank's shard from. The GPU never holds the fp32 model.
  MasterWeights(torch::nn::Module& net, c10::ScalarType dtype, const torch::Device& device);

  // What the optimizer updates: for each trainable parameter in `params` order, its fp32 master
  // (the parameter itself when it stayed fp32).
  std::vector<torch::Tensor> optimizer_params(const std::vector<torch::Tensor>& params) const;
  // The fp32 tensor that holds `param`'s value (itself when it was not converted).
  const torch::Tensor& master_of(const torch::Tensor& param) const;

  void attach_grads(bool fp32_copies);
  void copy_to_model();
  // Releases the masters' gradient references (after zero_grad).
  void release_grads();
  size_t converted() const { return model_.size(); }
  // trainer.strategy zero2: the optimizer holds fp32 shards of `params` instead
  // (strobe/distributed/zero2.h): their whole masters are freed, and master_of(p) is p itself.
  void drop_masters(const std::vector<torch::Tensor>& params);
  // The masters left (the host-side build's, of parameters the optimizer does not update) move to
  // `device`, beside their parameters.
  void move_masters(const torch::Device& device);

 private:
  void convert(torch::nn::Module& net, c10::ScalarType dtype, const std::optional<torch::Device>& host_to);

  std::vector<torch::Tensor> model_, master_;  // converted parameters and their fp32 masters
  std::unordered_map<const c10::TensorImpl*, size_t> index_;
};

}  // namespace strobe
