// Fused optimizers: argument checks, the CPU implementation of fused_adamw_/fused_adam_/fused_sgd_
// (torch::optim's ATen ops, in torch::optim's order), the C++ wrappers and the Optimizer classes.
#include "strobe/ops/fused_optimizers.h"

#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include "strobe/ops/ops.h"

namespace strobe::ops {

using at::Tensor;
using at::TensorList;

namespace detail {

void check_optional_scalar(const std::optional<Tensor>& t, const at::Device& device,
                           const char* op, const char* what) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->numel() == 1 && t->scalar_type() == at::kFloat, op, ": ", what,
              " must be a float32 scalar tensor, got ", t->scalar_type(), " ", t->sizes());
  TORCH_CHECK(t->device() == device, op, ": ", what, " is on ", t->device(),
              " but the parameters are on ", device);
}

void check_list(TensorList list, TensorList params, const char* op, const char* what,
                bool allow_empty) {
  if (allow_empty && list.empty()) return;
  TORCH_CHECK(list.size() == params.size(), op, ": ", what, " has ", list.size(),
              " tensors but params has ", params.size());
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK(list[i].defined(), op, ": ", what, "[", i, "] is undefined");
    TORCH_CHECK(list[i].device() == params[i].device(), op, ": ", what, "[", i, "] is on ",
                list[i].device(), " but params[", i, "] is on ", params[i].device());
    TORCH_CHECK(at::isFloatingType(list[i].scalar_type()), op, ": ", what, "[", i,
                "] must be floating point");
  }
}

void check_same_shape(TensorList list, TensorList params, const char* op, const char* what) {
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK(list[i].numel() == params[i].numel(), op, ": ", what, "[", i, "] has ",
                list[i].numel(), " elements but params[", i, "] has ", params[i].numel());
  }
}

// The learning rate as a device scalar (lr_tensor): 0-dim float64 beside the parameters, >= 0
// (checked where it can be read without a sync: on the CPU).
void check_lr_tensor(const std::optional<Tensor>& t, const at::Device& device, const char* op) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->numel() == 1 && t->scalar_type() == at::kDouble, op,
              ": lr_tensor must be a float64 scalar tensor, got ", t->scalar_type(), " ", t->sizes());
  TORCH_CHECK(t->device() == device, op, ": lr_tensor is on ", t->device(), " but the parameters are on ", device);
  if (device.is_cpu()) TORCH_CHECK(t->item<double>() >= 0, op, ": invalid learning rate ", t->item<double>());
}

// Checks shared by both devices; returns the device of the lists.
at::Device check_adam_args(const char* op, TensorList params, TensorList grads,
                           TensorList exp_avgs, TensorList exp_avg_sqs,
                           TensorList max_exp_avg_sqs, TensorList steps, double lr, double beta1,
                           double beta2, double eps, double weight_decay, bool amsgrad,
                           const std::optional<Tensor>& found,
                           const std::optional<Tensor>& mult) {
  TORCH_CHECK(!params.empty(), op, ": params is empty");
  TORCH_CHECK(lr >= 0, op, ": invalid learning rate ", lr);
  TORCH_CHECK(eps >= 0, op, ": invalid epsilon ", eps);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, op, ": invalid beta1 ", beta1);
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, op, ": invalid beta2 ", beta2);
  TORCH_CHECK(weight_decay >= 0, op, ": invalid weight_decay ", weight_decay);
  const at::Device device = params[0].device();
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].defined() && params[i].device() == device, op, ": params[", i,
                "] must be defined and on ", device);
  }
  check_list(params, params, op, "params", false);
  check_list(grads, params, op, "grads", false);
  check_list(exp_avgs, params, op, "exp_avgs", false);
  check_list(exp_avg_sqs, params, op, "exp_avg_sqs", false);
  check_list(max_exp_avg_sqs, params, op, "max_exp_avg_sqs", !amsgrad);
  check_list(steps, params, op, "steps", false);
  check_same_shape(grads, params, op, "grads");
  check_same_shape(exp_avgs, params, op, "exp_avgs");
  check_same_shape(exp_avg_sqs, params, op, "exp_avg_sqs");
  if (amsgrad) check_same_shape(max_exp_avg_sqs, params, op, "max_exp_avg_sqs");
  for (size_t i = 0; i < steps.size(); ++i) {
    TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat, op, ": steps[", i,
                "] must be a float32 scalar tensor");
  }
  check_optional_scalar(found, device, op, "found_nonfinite");
  check_optional_scalar(mult, device, op, "grad_multiplier");
  return device;
}

at::Device check_sgd_args(const char* op, TensorList params, TensorList grads,
                          TensorList momentum_buffers, TensorList steps, double lr,
                          double momentum, double dampening, double weight_decay, bool nesterov,
                          const std::optional<Tensor>& found, const std::optional<Tensor>& mult) {
  TORCH_CHECK(!params.empty(), op, ": params is empty");
  TORCH_CHECK(lr >= 0, op, ": invalid learning rate ", lr);
  TORCH_CHECK(momentum >= 0, op, ": invalid momentum ", momentum);
  TORCH_CHECK(weight_decay >= 0, op, ": invalid weight_decay ", weight_decay);
  TORCH_CHECK(!nesterov || (momentum > 0 && dampening == 0), op,
              ": nesterov momentum requires a momentum and zero dampening");
  const at::Device device = params[0].device();
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].defined() && params[i].device() == device, op, ": params[", i,
                "] must be defined and on ", device);
  }
  check_list(grads, params, op, "grads", false);
  check_same_shape(grads, params, op, "grads");
  TORCH_CHECK(momentum == 0 || (!momentum_buffers.empty() && !steps.empty()), op,
              ": momentum != 0 needs momentum_buffers and steps");
  check_list(momentum_buffers, params, op, "momentum_buffers", true);
  check_same_shape(momentum_buffers, params, op, "momentum_buffers");
  check_list(steps, params, op, "steps", true);
  for (size_t i = 0; i < steps.size(); ++i) {
    TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat, op, ": steps[", i,
                "] must be a float32 scalar tensor");
  }
  check_optional_scalar(found, device, op, "found_nonfinite");
  check_optional_scalar(mult, device, op, "grad_multiplier");
  return device;
}

at::Device check_ema_args(TensorList averages, TensorList sources, double weight, const std::optional<Tensor>& skip) {
  const char* op = "ema_update_";
  TORCH_CHECK(averages.size() == sources.size(), op, ": ", averages.size(), " averages but ", sources.size(), " sources");
  TORCH_CHECK(weight >= 0 && weight <= 1, op, ": weight must be in [0, 1], got ", weight);
  const at::Device device = averages.empty() ? at::Device(at::kCPU) : averages[0].device();
  for (size_t i = 0; i < averages.size(); ++i) {
    const Tensor& a = averages[i];
    const Tensor& s = sources[i];
    TORCH_CHECK(a.defined() && s.defined() && a.device() == device && s.device() == device, op, ": averages[", i,
                "] and sources[", i, "] must be defined and on ", device);
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_non_overlapping_and_dense(), op, ": averages[", i,
                "] must be a dense float32 tensor, got ", a.scalar_type());
    TORCH_CHECK(s.is_floating_point() && s.sizes() == a.sizes() && s.strides() == a.strides(), op, ": sources[", i,
                "] must be a floating tensor laid out like averages[", i, "] (", a.sizes(), "), got ", s.scalar_type(), " ",
                s.sizes());
  }
  check_optional_scalar(skip, device, op, "skip");
  return device;
}

}  // namespace detail

namespace {

bool skip_step(const std::optional<Tensor>& found) {
  return found.has_value() && found->defined() && found->item<float>() != 0.f;
}

Tensor scaled_grad(const Tensor& g, const Tensor& p, const std::optional<Tensor>& mult) {
  Tensor out = g.to(p.scalar_type());
  if (mult.has_value() && mult->defined()) out = out * mult->to(p.scalar_type());
  return out;
}

void adam_cpu(const char* op, bool decoupled, TensorList params, TensorList grads,
              TensorList exp_avgs, TensorList exp_avg_sqs, TensorList max_exp_avg_sqs,
              TensorList steps, double lr, double beta1, double beta2, double eps,
              double weight_decay, bool amsgrad, const std::optional<Tensor>& found,
              const std::optional<Tensor>& mult) {
  detail::check_adam_args(op, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
                          beta1, beta2, eps, weight_decay, amsgrad, found, mult);
  if (skip_step(found)) return;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor p = params[i];
    Tensor grad = scaled_grad(grads[i], p, mult);
    if (weight_decay != 0) {
      if (decoupled) {
        p.mul_(1 - lr * weight_decay);
      } else {
        grad = grad.add(p, weight_decay);
      }
    }
    Tensor exp_avg = exp_avgs[i], exp_avg_sq = exp_avg_sqs[i];
    Tensor step = steps[i];
    step.add_(1);
    const double s = step.item<double>();
    const double bias_correction1 = 1 - std::pow(beta1, s);
    const double bias_correction2 = 1 - std::pow(beta2, s);
    exp_avg.mul_(beta1).add_(grad, 1 - beta1);
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    Tensor denom;
    if (amsgrad) {
      Tensor max_exp_avg_sq = max_exp_avg_sqs[i];
      at::max_out(max_exp_avg_sq, exp_avg_sq, max_exp_avg_sq);
      denom = (max_exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(eps);
    } else {
      denom = (exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(eps);
    }
    p.addcdiv_(exp_avg, denom, -lr / bias_correction1);
  }
}

double cpu_lr(double lr, const std::optional<Tensor>& lr_t, const char* op, const Tensor& p0) {
  detail::check_lr_tensor(lr_t, p0.device(), op);
  return lr_t.has_value() && lr_t->defined() ? lr_t->item<double>() : lr;
}

void fused_adamw_cpu(TensorList params, TensorList grads, TensorList exp_avgs,
                     TensorList exp_avg_sqs, TensorList max_exp_avg_sqs, TensorList steps,
                     double lr, double beta1, double beta2, double eps, double weight_decay,
                     bool amsgrad, const std::optional<Tensor>& found,
                     const std::optional<Tensor>& mult, const std::optional<Tensor>& lr_t) {
  if (!params.empty()) lr = cpu_lr(lr, lr_t, "fused_adamw_", params[0]);
  adam_cpu("fused_adamw_", true, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
           beta1, beta2, eps, weight_decay, amsgrad, found, mult);
}

void fused_adam_cpu(TensorList params, TensorList grads, TensorList exp_avgs,
                    TensorList exp_avg_sqs, TensorList max_exp_avg_sqs, TensorList steps,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool amsgrad, const std::optional<Tensor>& found,
                    const std::optional<Tensor>& mult, const std::optional<Tensor>& lr_t) {
  if (!params.empty()) lr = cpu_lr(lr, lr_t, "fused_adam_", params[0]);
  adam_cpu("fused_adam_", false, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
           beta1, beta2, eps, weight_decay, amsgrad, found, mult);
}

void fused_sgd_cpu(TensorList params, TensorList grads, TensorList momentum_buffers,
                   TensorList steps, double lr, double momentum, double dampening,
                   double weight_decay, bool nesterov, const std::optional<Tensor>& found,
                   const std::optional<Tensor>& mult, const std::optional<Tensor>& lr_t) {
  if (!params.empty()) lr = cpu_lr(lr, lr_t, "fused_sgd_", params[0]);
  detail::check_sgd_args("fused_sgd_", params, grads, momentum_buffers, steps, lr, momentum,
                         dampening, weight_decay, nesterov, found, mult);
  if (skip_step(found)) return;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor p = params[i];
    Tensor d_p = scaled_grad(grads[i], p, mult);
    if (weight_decay != 0) d_p = d_p.add(p, weight_decay);
    if (momentum != 0) {
      Tensor buf = momentum_buffers[i];
      Tensor step = steps[i];
      if (step.item<float>() == 0.f) {
        buf.copy_(d_p);
      } else {
        buf.mul_(momentum).add_(d_p, 1 - dampening);
      }
      step.add_(1);
      d_p = nesterov ? d_p.add(buf, momentum) : buf;
    }
    p.add_(d_p, -lr);
  }
}

using AdamOpSig = void(TensorList, TensorList, TensorList, TensorList, TensorList, TensorList,
                       double, double, double, double, double, bool, const std::optional<Tensor>&,
                       const std::optional<Tensor>&, const std::optional<Tensor>&);
using SgdOpSig = void(TensorList, TensorList, TensorList, TensorList, double, double, double,
                      double, bool, const std::optional<Tensor>&, const std::optional<Tensor>&,
                      const std::optional<Tensor>&);

std::optional<Tensor> opt(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

}  // namespace

void fused_adamw_(TensorList params, TensorList grads, TensorList exp_avgs,
                  TensorList exp_avg_sqs, TensorList max_exp_avg_sqs, TensorList steps,
                  const AdamArgs& a, const Tensor& found_nonfinite,
                  const Tensor& grad_multiplier) {
  if (params.empty()) return;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::fused_adamw_", "")
                             .typed<AdamOpSig>();
  op.call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, a.lr, a.beta1, a.beta2,
          a.eps, a.weight_decay, a.amsgrad, opt(found_nonfinite), opt(grad_multiplier), opt(a.lr_tensor));
}

void fused_adam_(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                 TensorList max_exp_avg_sqs, TensorList steps, const AdamArgs& a,
                 const Tensor& found_nonfinite, const Tensor& grad_multiplier) {
  if (params.empty()) return;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::fused_adam_", "")
                             .typed<AdamOpSig>();
  op.call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, a.lr, a.beta1, a.beta2,
          a.eps, a.weight_decay, a.amsgrad, opt(found_nonfinite), opt(grad_multiplier), opt(a.lr_tensor));
}

void fused_sgd_(TensorList params, TensorList grads, TensorList momentum_buffers,
                TensorList steps, const SgdArgs& a, const Tensor& found_nonfinite,
                const Tensor& grad_multiplier) {
  if (params.empty()) return;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::fused_sgd_", "")
                             .typed<SgdOpSig>();
  op.call(params, grads, momentum_buffers, steps, a.lr, a.momentum, a.dampening, a.weight_decay,
          a.nesterov, opt(found_nonfinite), opt(grad_multiplier), opt(a.lr_tensor));
}

// ---- parameter state serialization (torch::optim's archive layout) -----------------------------
namespace {

void write_step(torch::serialize::OutputArchive& archive, const Tensor& step) {
  const int64_t s = step.defined() ? static_cast<int64_t>(step.item<double>()) : 0;
  archive.write("step", c10::IValue(s));
}

Tensor read_step(torch::serialize::InputArchive& archive, int64_t missing) {
  c10::IValue v;
  const int64_t s = archive.try_read("step", v) ? v.toInt() : missing;
  return at::scalar_tensor(static_cast<double>(s), at::kFloat);
}

Tensor read_tensor(torch::serialize::InputArchive& archive, const char* key) {
  c10::IValue v;
  return archive.try_read(key, v) ? v.toTensor() : Tensor();
}

void write_tensor(torch::serialize::OutputArchive& archive, const char* key, const Tensor& t) {
  if (t.defined()) archive.write(key, c10::IValue(t));
}

}  // namespace

void FusedAdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  write_step(archive, step());
  write_tensor(archive, "exp_avg", exp_avg());
  write_tensor(archive, "exp_avg_sq", exp_avg_sq());
  write_tensor(archive, "max_exp_avg_sq", max_exp_avg_sq());
}

void FusedAdamParamState::serialize(torch::serialize::InputArchive& archive) {
  step(read_step(archive, 0));
  exp_avg(read_tensor(archive, "exp_avg"));
  exp_avg_sq(read_tensor(archive, "exp_avg_sq"));
  max_exp_avg_sq(read_tensor(archive, "max_exp_avg_sq"));
}

void FusedSGDParamState::serialize(torch::serialize::OutputArchive& archive) const {
  write_tensor(archive, "momentum_buffer", momentum_buffer());
  write_step(archive, step());
}

void FusedSGDParamState::serialize(torch::serialize::InputArchive& archive) {
  momentum_buffer(read_tensor(archive, "momentum_buffer"));
  // torch::optim::SGD saves no step: a saved buffer has been initialised.
  step(read_step(archive, momentum_buffer().defined() ? 1 : 0));
}

// ---- classes ------------------------------------------------------------------------------------
std::pair<Tensor, Tensor> FusedOptimizerBase::take_guards() {
  return {std::exchange(found_nonfinite_, Tensor()), std::exchange(grad_multiplier_, Tensor())};
}

void FusedOptimizerBase::enable_device_lr() {
  if (!device_lrs_.empty()) return;
  for (const auto& group : param_groups()) {
    TORCH_CHECK(!group.params().empty(), "enable_device_lr: a parameter group is empty");
    const at::Device device = group.params()[0].device();
    for (const Tensor& p : group.params())
      TORCH_CHECK(p.device() == device, "enable_device_lr: the parameters of a group are on ", device, " and ", p.device());
    device_lrs_.push_back(at::empty({}, at::TensorOptions().dtype(at::kDouble).device(device)));
  }
  sync_device_lr();
}

void FusedOptimizerBase::sync_device_lr() {
  for (size_t g = 0; g < device_lrs_.size(); ++g) device_lrs_[g].fill_(param_groups()[g].options().get_lr());
}

namespace {

// State tensors live beside their parameter, laid out like it (the CUDA kernel walks both flat; a
// channels_last parameter has channels_last moments); a loaded checkpoint may hold them on the CPU
// or in another layout.
Tensor on_device_of(const Tensor& state, const Tensor& p, at::ScalarType dtype) {
  if (!state.defined()) return state;
  if (state.device() == p.device() && state.scalar_type() == dtype && state.strides() == p.strides() &&
      state.is_non_overlapping_and_dense()) {
    return state;
  }
  return at::empty_like(p, p.options().dtype(dtype)).copy_(state);
}

Tensor zeros_for(const Tensor& p) { return at::zeros_like(p, p.options(), at::MemoryFormat::Preserve); }

// The 0-dim fp32 step count beside its parameter.
Tensor step_on_device_of(const Tensor& step, const Tensor& p) {
  if (!step.defined() || (step.device() == p.device() && step.scalar_type() == at::kFloat)) return step;
  return step.to(p.device(), at::kFloat);
}

Tensor to_device(const Tensor& t, const at::Device& d) {
  // Host-to-device may be asynchronous; device-to-host must not (the CPU path reads it at once).
  return t.defined() && t.device() != d ? t.to(d, /*non_blocking=*/d.is_cuda()) : t;
}

// Parameters with a gradient, grouped by device (usually one).
struct DeviceLists {
  at::Device device;
  std::vector<Tensor> params, grads, a, b, c, steps;
};

DeviceLists& lists_for(std::vector<DeviceLists>& all, const at::Device& d) {
  for (auto& l : all) {
    if (l.device == d) return l;
  }
  all.push_back(DeviceLists{d, {}, {}, {}, {}, {}, {}});
  return all.back();
}

Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (closure == nullptr) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

template <typename Options>
void check_adam_options(const Options& o) {
  TORCH_CHECK(o.lr() >= 0, "Invalid learning rate: ", o.lr());
  TORCH_CHECK(o.eps() >= 0, "Invalid epsilon value: ", o.eps());
  TORCH_CHECK(0 <= std::get<0>(o.betas()) && std::get<0>(o.betas()) < 1.0,
              "Invalid beta parameter at index 0: ", std::get<0>(o.betas()));
  TORCH_CHECK(0 <= std::get<1>(o.betas()) && std::get<1>(o.betas()) < 1.0,
              "Invalid beta parameter at index 1: ", std::get<1>(o.betas()));
  TORCH_CHECK(o.weight_decay() >= 0, "Invalid weight_decay value: ", o.weight_decay());
}

template <typename Options>
void adam_family_step(FusedOptimizerBase& self, const Tensor& found, const Tensor& mult) {
  constexpr bool decoupled = std::is_same_v<Options, torch::optim::AdamWOptions>;
  for (size_t gi = 0; gi < self.param_groups().size(); ++gi) {
    auto& group = self.param_groups()[gi];
    const auto& o = static_cast<const Options&>(group.options());
    std::vector<DeviceLists> per_device;
    for (const Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(), "fused Adam does not support sparse gradients");
      const at::ScalarType dtype = p.scalar_type();
      auto& slot = self.state()[p.unsafeGetTensorImpl()];
      if (slot == nullptr) {
        auto s = std::make_unique<FusedAdamParamState>();
        s->step(at::zeros({}, p.options().dtype(at::kFloat)));
        s->exp_avg(zeros_for(p));
        s->exp_avg_sq(zeros_for(p));
        slot = std::move(s);
      }
      auto& s = static_cast<FusedAdamParamState&>(*slot);
      s.step(step_on_device_of(s.step(), p));
      s.exp_avg(on_device_of(s.exp_avg(), p, dtype));
      s.exp_avg_sq(on_device_of(s.exp_avg_sq(), p, dtype));
      if (o.amsgrad()) {
        if (!s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(zeros_for(p));
        s.max_exp_avg_sq(on_device_of(s.max_exp_avg_sq(), p, dtype));
      }
      DeviceLists& l = lists_for(per_device, p.device());
      l.params.push_back(p);
      l.grads.push_back(p.grad());
      l.a.push_back(s.exp_avg());
      l.b.push_back(s.exp_avg_sq());
      if (o.amsgrad()) l.c.push_back(s.max_exp_avg_sq());
      l.steps.push_back(s.step());
    }
    AdamArgs args;
    args.lr = o.lr();
    args.beta1 = std::get<0>(o.betas());
    args.beta2 = std::get<1>(o.betas());
    args.eps = o.eps();
    args.weight_decay = o.weight_decay();
    args.amsgrad = o.amsgrad();
    args.lr_tensor = self.lr_tensor(gi);
    for (const DeviceLists& l : per_device) {
      const Tensor f = to_device(found, l.device), m = to_device(mult, l.device);
      if constexpr (decoupled) {
        fused_adamw_(l.params, l.grads, l.a, l.b, l.c, l.steps, args, f, m);
      } else {
        fused_adam_(l.params, l.grads, l.a, l.b, l.c, l.steps, args, f, m);
      }
    }
  }
}

}  // namespace

template <typename Options>
FusedAdamFamily<Options>::FusedAdamFamily(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                                          Options defaults)
    : FusedOptimizerBase(param_groups, std::make_unique<Options>(defaults)) {
  check_adam_options(defaults);
}

template <typename Options>
Tensor FusedAdamFamily<Options>::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  Tensor loss = run_closure(closure);
  auto [found, mult] = take_guards();
  adam_family_step<Options>(*this, found, mult);
  return loss;
}

template <typename Options>
void FusedAdamFamily<Options>::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<FusedAdamParamState, Options>(archive, *this);
}

template <typename Options>
void FusedAdamFamily<Options>::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<FusedAdamParamState, Options>(archive, *this);
}

template class FusedAdamFamily<torch::optim::AdamWOptions>;
template class FusedAdamFamily<torch::optim::AdamOptions>;

FusedSGD::FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                   torch::optim::SGDOptions defaults)
    : FusedOptimizerBase(param_groups, std::make_unique<torch::optim::SGDOptions>(defaults)) {
  TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
  TORCH_CHECK(defaults.momentum() >= 0, "Invalid momentum value: ", defaults.momentum());
  TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ",
              defaults.weight_decay());
  TORCH_CHECK(!defaults.nesterov() || (defaults.momentum() > 0 && defaults.dampening() == 0),
              "Nesterov momentum requires a momentum and zero dampening");
}

Tensor FusedSGD::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  Tensor loss = run_closure(closure);
  auto [found, mult] = take_guards();
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    auto& group = param_groups_[gi];
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    const bool with_momentum = o.momentum() != 0;
    std::vector<DeviceLists> per_device;
    for (const Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(), "FusedSGD does not support sparse gradients");
      DeviceLists& l = lists_for(per_device, p.device());
      l.params.push_back(p);
      l.grads.push_back(p.grad());
      if (!with_momentum) continue;
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (slot == nullptr) {
        auto s = std::make_unique<FusedSGDParamState>();
        s->step(at::zeros({}, p.options().dtype(at::kFloat)));
        s->momentum_buffer(zeros_for(p));
        slot = std::move(s);
      }
      auto& s = static_cast<FusedSGDParamState&>(*slot);
      if (!s.momentum_buffer().defined()) {
        s.momentum_buffer(zeros_for(p));
        s.step(at::zeros({}, p.options().dtype(at::kFloat)));
      }
      s.step(step_on_device_of(s.step(), p));
      s.momentum_buffer(on_device_of(s.momentum_buffer(), p, p.scalar_type()));
      l.a.push_back(s.momentum_buffer());
      l.steps.push_back(s.step());
    }
    SgdArgs args;
    args.lr = o.lr();
    args.momentum = o.momentum();
    args.dampening = o.dampening();
    args.weight_decay = o.weight_decay();
    args.nesterov = o.nesterov();
    args.lr_tensor = lr_tensor(gi);
    for (const DeviceLists& l : per_device) {
      fused_sgd_(l.params, l.grads, l.a, l.steps, args, to_device(found, l.device),
                 to_device(mult, l.device));
    }
  }
  return loss;
}

void FusedSGD::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<FusedSGDParamState, torch::optim::SGDOptions>(archive, *this);
}

void FusedSGD::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<FusedSGDParamState, torch::optim::SGDOptions>(archive, *this);
}

void ema_update_cpu(TensorList averages, TensorList sources, double weight, const std::optional<Tensor>& skip) {
  detail::check_ema_args(averages, sources, weight, skip);
  if (skip.has_value() && skip->defined() && skip->item<float>() != 0.f) return;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < averages.size(); ++i) {
    Tensor a = averages[i];
    a.add_(sources[i].to(at::kFloat).sub(a), weight);
  }
}

void ema_update_(TensorList averages, TensorList sources, double weight, const Tensor& skip) {
  if (averages.empty()) return;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::ema_update_", "")
                             .typed<void(TensorList, TensorList, double, const std::optional<Tensor>&)>();
  op.call(averages, sources, weight, skip.defined() ? std::optional<Tensor>(skip) : std::nullopt);
}

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("fused_adamw_", &strobe::ops::fused_adamw_cpu);
  m.impl("fused_adam_", &strobe::ops::fused_adam_cpu);
  m.impl("fused_sgd_", &strobe::ops::fused_sgd_cpu);
  m.impl("ema_update_", &strobe::ops::ema_update_cpu);
}
