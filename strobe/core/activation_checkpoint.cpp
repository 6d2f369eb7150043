#include "strobe/core/activation_checkpoint.h"

#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include "strobe/core/forensics.h"
#include "strobe/core/rng_state.h"
#include "strobe/distributed/fsdp.h"
#include "strobe/ops/cuda_graph.h"

namespace strobe {

ActivationCheckpointing ActivationCheckpointing::read(config::Section& cfg) {
  ActivationCheckpointing ac;
  const auto mode = cfg.get_choice("activation_checkpointing", "none", {"none", "blocks", "every_k"});
  ac.mode = mode == "blocks" ? Mode::kBlocks : mode == "every_k" ? Mode::kEveryK : Mode::kNone;
  if (ac.mode == Mode::kEveryK) {
    ac.every = cfg.get_int("activation_checkpointing_every", 2, 1);
  } else if (cfg.has("activation_checkpointing_every")) {
    cfg.fail("activation_checkpointing_every", "applies to activation_checkpointing: every_k, not " + mode);
  }
  return ac;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct AutocastState {
  c10::DeviceType type;
  bool enabled;
  c10::ScalarType dtype;
};

// Sets an autocast state for a scope and puts the previous one back.
class AutocastRestore {
 public:
  explicit AutocastRestore(const std::vector<AutocastState>& states) {
    for (const auto& s : states) {
      prev_.push_back({s.type, at::autocast::is_autocast_enabled(s.type), at::autocast::get_autocast_dtype(s.type)});
      at::autocast::set_autocast_dtype(s.type, s.dtype);
      at::autocast::set_autocast_enabled(s.type, s.enabled);
      any_ = any_ || s.enabled;
    }
    if (any_) at::autocast::increment_nesting();
  }
  ~AutocastRestore() {
    if (any_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    for (const auto& s : prev_) {
      at::autocast::set_autocast_enabled(s.type, s.enabled);
      at::autocast::set_autocast_dtype(s.type, s.dtype);
    }
  }
  AutocastRestore(const AutocastRestore&) = delete;
  AutocastRestore& operator=(const AutocastRestore&) = delete;

 private:
  std::vector<AutocastState> prev_;
  bool any_ = false;
};

// The generators' states saved at the forward; restored for the recompute, the states the
// backward had before put back afterwards (a fork, as torch.random.fork_rng).
struct RngStates {
  std::vector<std::pair<int, torch::Tensor>> states;  // (generator, state): -1 the CPU's, else a CUDA device's

  static RngStates save(const std::optional<c10::Device>& accelerator) {
    RngStates r;
    r.states.emplace_back(-1, generator_state(-1));
    if (accelerator) {
      // CUDA's generator hands out its state during capture too, but the recompute would not
      // replay the captured draws: refused.
      if (ops::stream_capturing(*accelerator))
        throw std::runtime_error("activation checkpointing: a checkpointed block that preserves its random number "
                                 "state cannot be captured in a CUDA graph (the recompute cannot draw the captured "
                                 "forward's numbers); a block that draws no random numbers passes preserve_rng false, "
                                 "or run without trainer.cuda_graphs");
      r.states.emplace_back(accelerator->index(), generator_state(accelerator->index()));
    }
    return r;
  }
};

class RngFork {
 public:
  explicit RngFork(const RngStates& saved) {
    for (const auto& [device, state] : saved.states) {
      prev_.emplace_back(device, generator_state(device));
      set_generator_state(device, state);
    }
  }
  ~RngFork() {
    for (const auto& [device, state] : prev_) set_generator_state(device, state);
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  std::vector<std::pair<int, torch::Tensor>> prev_;
};

// What backward needs besides the saved inputs; held by the node (a capsule in saved_data).
struct CheckpointState : torch::CustomClassHolder {
  BlockFunction fn;
  std::shared_ptr<torch::nn::Module> block;
  std::vector<torch::Tensor> params;  // block's parameters that require a gradient, in apply's order
  std::vector<bool> input_requires_grad;  // of the defined inputs, in order
  std::vector<bool> input_defined;        // of every input fn takes (undefined ones do not reach the node)
  std::vector<AutocastState> autocast;
  std::optional<RngStates> rng;

  // fn's arguments from the node's inputs: the undefined ones put back in their places.
  std::vector<torch::Tensor> arguments(const std::vector<torch::Tensor>& defined) const {
    std::vector<torch::Tensor> all;
    size_t next = 0;
    for (const bool d : input_defined) all.push_back(d ? defined.at(next++) : torch::Tensor());
    return all;
  }
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // Tensor lists as at::TensorList: Function::apply counts their elements as the node's inputs (a
  // std::vector argument would count as one non-tensor argument).
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<CheckpointState> state, at::TensorList inputs,
                               at::TensorList params) {
    (void)params;  // inputs of the node so that their gradients flow out of it; fn uses them as the block's
    ctx->save_for_backward(inputs.vec());
    auto outputs = state->fn(state->arguments(inputs.vec()));
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    variable_list inputs;
    inputs.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      auto t = saved[i].detach();
      if (state->input_requires_grad[i]) t.requires_grad_(true);
      inputs.push_back(std::move(t));
    }

    // The buffers as the forward left them; the recompute's updates are undone (BatchNorm counts
    // and averages a batch once).
    std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers;
    for (auto& b : state->block->buffers()) {
      if (b.defined()) buffers.emplace_back(b, b.clone());
    }
    variable_list outputs;
    {
      std::optional<RngFork> fork;
      if (state->rng) fork.emplace(*state->rng);
      AutocastRestore autocast(state->autocast);
      torch::AutoGradMode grad_mode(true);
      RecomputeScope forensics;  // replay's tracer: these are the block's forward ops
      outputs = state->fn(state->arguments(inputs));
    }

    variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (grad_outputs[i].defined() && outputs[i].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    variable_list targets;
    std::vector<size_t> input_slot;  // targets[i] is inputs[input_slot[i]] for i < input_slot.size()
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].requires_grad()) {
        targets.push_back(inputs[i]);
        input_slot.push_back(i);
      }
    }
    for (const auto& p : state->params) targets.push_back(p);

    // One gradient per forward argument: the state (none), each input, each parameter.
    variable_list result(1 + inputs.size() + state->params.size());
    variable_list grads;
    if (!roots.empty() && !targets.empty()) {
      grads = torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
    }
    {
      // After the gradients: the recomputed graph saved the buffers (BatchNorm's running statistics).
      torch::NoGradGuard no_grad;
      for (auto& [b, copy] : buffers) b.copy_(copy);
    }
    if (grads.empty()) return result;
    for (size_t i = 0; i < input_slot.size(); ++i) result[1 + input_slot[i]] = grads[i];
    for (size_t j = 0; j < state->params.size(); ++j) result[1 + inputs.size() + j] = grads[input_slot.size() + j];
    return result;
  }
};

}  // namespace

std::vector<torch::Tensor> checkpoint_block(torch::nn::Module& block, const std::vector<torch::Tensor>& inputs,
                                            const BlockFunction& fn, bool preserve_rng) {
  if (!torch::GradMode::is_enabled()) return fn(inputs);
  std::vector<torch::Tensor> params;
  for (auto& p : block.parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  bool any_input = false;
  std::optional<c10::Device> accelerator;
  auto state = c10::make_intrusive<CheckpointState>();
  std::vector<torch::Tensor> defined;
  for (const auto& t : inputs) {
    state->input_defined.push_back(t.defined());
    if (!t.defined()) continue;
    defined.push_back(t);
    state->input_requires_grad.push_back(t.requires_grad());
    any_input = any_input || t.requires_grad();
    if (!t.is_cpu() && !accelerator) accelerator = t.device();
  }
  if (!any_input && params.empty()) return fn(inputs);

  state->fn = fn;
  state->block = block.shared_from_this();
  state->params = params;
  for (const auto type : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
    state->autocast.push_back({type, at::autocast::is_autocast_enabled(type), at::autocast::get_autocast_dtype(type)});
  }
  if (preserve_rng) state->rng = RngStates::save(accelerator);
  return CheckpointFunction::apply(std::move(state), at::TensorList(defined), at::TensorList(params));
}

bool runs_in_unit(const torch::nn::Module& block) { return distributed::unit_of(block) != nullptr; }

torch::Tensor run_in_unit(torch::nn::Module& module, const torch::Tensor& x,
                          const std::function<torch::Tensor(const torch::Tensor&)>& fn) {
  auto* unit = distributed::unit_of(module);
  if (!unit) return fn(x);
  return distributed::run_unit(*unit, {x}, [&fn](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{fn(in[0])}; })[0];
}

std::vector<torch::Tensor> run_model_block(const ActivationCheckpointing& ac, int64_t index, torch::nn::Module& block,
                                           const std::vector<torch::Tensor>& inputs, const BlockFunction& fn,
                                           bool preserve_rng) {
  auto* unit = distributed::unit_of(block);
  if (!ac.applies(index)) return unit ? distributed::run_unit(*unit, inputs, fn) : fn(inputs);
  if (!unit) return checkpoint_block(block, inputs, fn, preserve_rng);
  return distributed::run_unit(*unit, inputs, [&block, fn, preserve_rng](const std::vector<torch::Tensor>& in) {
    return checkpoint_block(block, in, fn, preserve_rng);
  });
}

}  // namespace strobe
