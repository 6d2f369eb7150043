#include "strobe/core/step_pipeline.h"

#include <map>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/master_weights.h"
#include "strobe/core/precision.h"
#include "strobe/distributed/strategy.h"

#if STROBE_HAS_OPS
#include "strobe/ops/fused_optimizers.h"
#endif

namespace strobe {

namespace {

torch::Tensor max_defined(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  return torch::maximum(a, b);
}

}  // namespace

StepRecord clone_record(const StepRecord& r) {
  auto c = [](const torch::Tensor& t) { return t.defined() ? t.clone() : t; };
  StepRecord out;
  out.nonfinite = c(r.nonfinite);
  out.loss_nonfinite = c(r.loss_nonfinite);
  out.grad_nonfinite = c(r.grad_nonfinite);
  out.skipped = c(r.skipped);
  out.grad_norms = c(r.grad_norms);
  out.grad_names = r.grad_names;
  for (const auto& l : r.losses) out.losses.push_back(c(l));
  for (const auto& b : r.buffers_before) out.buffers_before.push_back(c(b));
  out.spike = c(r.spike);
  out.spike_limit = c(r.spike_limit);
  out.spike_stats = c(r.spike_stats);
  return out;
}

StepPipeline::StepPipeline(const config::TrainerConfig& cfg, torch::nn::Module& net, torch::optim::Optimizer& optimizer,
                           GradScaler* scaler, MasterWeights* masters)
    : cfg_(cfg), optimizer_(optimizer), scaler_(scaler), masters_(masters) {
  fused_ = false;
#if STROBE_HAS_OPS
  fused_ = dynamic_cast<ops::FusedOptimizerBase*>(&optimizer) != nullptr;
#endif
  for (const auto& p : net.named_parameters()) {
    params_.push_back(p.value());
    param_names_.push_back(p.key());
  }
  std::map<c10::ScalarType, size_t> group_of;
  for (const auto& b : net.named_buffers()) {
    const size_t i = buffers_.size();
    buffers_.push_back(b.value());
    buffer_names_.push_back(b.key());
    auto it = group_of.find(b.value().scalar_type());
    if (it == group_of.end()) {
      group_of[b.value().scalar_type()] = buffer_groups_.size();
      buffer_groups_.push_back({i});
    } else {
      buffer_groups_[it->second].push_back(i);
    }
  }
  if (!params_.empty()) sticky_ = torch::zeros({}, params_[0].options().dtype(torch::kFloat32));
}

StepPipeline::~StepPipeline() = default;

void StepPipeline::set_sharded(distributed::Zero2Shards* shards) {
  TORCH_CHECK(strategy_, "StepPipeline::set_sharded before set_strategy");
  shards_ = shards;
  params_ = shards->shards();
  param_names_ = shards->names();
  grad_names_.reset();
}

void StepPipeline::arm(const StepGuard& g) {
  guard_ |= g;
  if (guard_.spike.armed() && sticky_.defined() &&
      (!spike_window_.defined() || spike_window_.size(1) != guard_.spike.window))
    init_spike_state();
}

void StepPipeline::init_spike_state() {
  const auto& sg = guard_.spike;
  auto f32 = sticky_.options();
  spike_window_ = torch::zeros({2, sg.window}, f32);
  spike_count_ = torch::zeros({}, f32);
  spike_pos_ = torch::zeros({}, f32.dtype(torch::kLong));
  spike_consecutive_ = torch::zeros({}, f32);
  spike_used_ = torch::tensor({sg.loss ? 1.f : 0.f, sg.grad_norm ? 1.f : 0.f}).to(f32.device());
  spike_positions_ = torch::arange(sg.window, f32);
  if (spike_loaded_.empty()) return;
  const auto& w = spike_loaded_.at("window");
  if (w.dim() == 2 && w.size(0) == 2 && w.size(1) == sg.window) {
    spike_window_.copy_(w);
    spike_count_.copy_(spike_loaded_.at("count"));
    spike_pos_.copy_(spike_loaded_.at("pos"));
    spike_consecutive_.copy_(spike_loaded_.at("consecutive"));
  } else {
    fmt::print(stderr, "nan_capture: the spike window changed since the checkpoint ({} -> {} steps): its statistics start anew\n",
               w.dim() == 2 ? w.size(1) : 0, sg.window);
  }
  spike_loaded_.clear();
}

torch::Tensor StepPipeline::spike_verdict(const torch::Tensor& values) {
  // Statistics of the accepted values before this step: population mean and std of the first
  // `count` slots (the window is filled in order, then overwritten oldest first).
  const auto& sg = guard_.spike;
  auto mask = (spike_positions_ < spike_count_).to(torch::kFloat32);  // [W]
  auto n = spike_count_.clamp_min(1.0);
  auto mean = (spike_window_ * mask).sum(1) / n;                                  // [2]
  auto std = (((spike_window_ - mean.unsqueeze(1)) * mask).square().sum(1) / n).sqrt();  // [2]
  auto ready = (spike_count_ >= static_cast<double>(sg.warmup)).to(torch::kFloat32);
  auto over = (values > mean + sg.zscore * std).to(torch::kFloat32) * spike_used_ * ready;  // [2]
  auto spike = over.amax();
  spike_consecutive_.copy_((spike_consecutive_ + 1.0) * spike);
  auto limit = sg.stop ? spike : spike * (spike_consecutive_ >= static_cast<double>(sg.max_consecutive)).to(torch::kFloat32);
  current_.spike = spike;
  current_.spike_limit = limit;
  current_.spike_stats = torch::stack({values[0], mean[0], std[0], values[1], mean[1], std[1], spike_consecutive_.clone(), over[0], over[1]});
  return spike;
}

void StepPipeline::accept_spike_values(const torch::Tensor& values, const torch::Tensor& skip) {
  // Only accepted steps enter the window: applied (not skipped for any reason) and finite.
  auto accept = (1.0 - skip) * torch::isfinite(values).all().to(torch::kFloat32);
  auto slot = spike_pos_.view({1});
  auto old = spike_window_.index_select(1, slot).squeeze(1);
  spike_window_.index_copy_(1, slot, torch::where(accept.to(torch::kBool), values, old).unsqueeze(1));
  spike_pos_.copy_((spike_pos_ + accept.to(torch::kLong)).remainder(guard_.spike.window));
  spike_count_.copy_((spike_count_ + accept).clamp_max(static_cast<double>(guard_.spike.window)));
}

void StepPipeline::reset_sticky() {
  if (sticky_.defined()) sticky_.zero_();
}

std::vector<torch::Tensor> StepPipeline::snapshot_buffers() const {
  // One flat copy per dtype: a handful of launches, whatever the number of BatchNorm layers.
  std::vector<torch::Tensor> flat;
  for (const auto& group : buffer_groups_) {
    std::vector<torch::Tensor> views;
    views.reserve(group.size());
    for (size_t i : group) views.push_back(buffers_[i].reshape({-1}));
    flat.push_back(torch::cat(views));
  }
  return flat;
}

std::vector<torch::Tensor> StepPipeline::unflatten_buffers(const std::vector<torch::Tensor>& flat) const {
  std::vector<torch::Tensor> out(buffers_.size());
  for (size_t g = 0; g < buffer_groups_.size() && g < flat.size(); ++g) {
    int64_t offset = 0;
    for (size_t i : buffer_groups_[g]) {
      const int64_t n = buffers_[i].numel();
      out[i] = flat[g].narrow(0, offset, n).view(buffers_[i].sizes());
      offset += n;
    }
  }
  return out;
}

void StepPipeline::restore_buffers(const std::vector<torch::Tensor>& flat, const torch::Tensor& skip) {
  auto cond = skip.to(torch::kBool);
  auto now = snapshot_buffers();
  for (size_t g = 0; g < buffer_groups_.size(); ++g) {
    auto chosen = torch::where(cond, flat[g], now[g]);
    std::vector<torch::Tensor> dst, src;
    int64_t offset = 0;
    for (size_t i : buffer_groups_[g]) {
      const int64_t n = buffers_[i].numel();
      dst.push_back(buffers_[i]);
      src.push_back(chosen.narrow(0, offset, n).view(buffers_[i].sizes()));
      offset += n;
    }
    at::_foreach_copy_(dst, src);
  }
}

void StepPipeline::begin_step() {
  torch::NoGradGuard ng;
  current_ = StepRecord{};
  loss_flag_ = torch::Tensor();
  if ((guard_.snapshot_buffers || guard_.restore_buffers) && !buffers_.empty())
    current_.buffers_before = snapshot_buffers();
}

torch::Tensor StepPipeline::prepare_backward(const torch::Tensor& loss) {
  {
    torch::NoGradGuard ng;
    auto detached = loss.detach();
    current_.losses.push_back(detached);
    if (guard_.check_loss)
      loss_flag_ = max_defined(loss_flag_, torch::isfinite(detached).logical_not().any().to(torch::kFloat32));
  }
  auto out = cfg_.accumulate_grad_batches > 1 ? loss / static_cast<double>(cfg_.accumulate_grad_batches) : loss;
  if (scaler_) out = scaler_->scale(out);
  return out;
}

// The one pass over the gradients: per-gradient L2 norms give both the non-finite flag (a NaN or
// Inf element makes its tensor's norm non-finite) and the total norm for clipping and spikes.
StepPipeline::GradPass StepPipeline::grad_pass(const std::vector<torch::Tensor>& grads, const std::vector<size_t>& with_grad,
                                               bool total) {
  GradPass out;
  StepRecord& rec = current_;
  rec.grad_norms = torch::stack(at::_foreach_norm(grads, 2, torch::kFloat32));
  if (shards_) {  // each rank has its shards' norms: the squares add up to the whole gradients'
    auto squares = rec.grad_norms.square();
    strategy_->reduce_sum(squares, distributed::CollectiveKind::kGradNorms);
    rec.grad_norms = squares.sqrt();
  }
  out.nonfinite = rec.grad_norms.isfinite().logical_not().any().to(torch::kFloat32);
  if (total) out.total_norm = torch::linalg_vector_norm(rec.grad_norms, 2);
  if (!grad_names_ || grad_names_->size() != with_grad.size()) {
    auto names = std::make_shared<std::vector<std::string>>();
    for (size_t i : with_grad) names->push_back(param_names_[i]);
    grad_names_ = std::move(names);
  }
  rec.grad_names = grad_names_;
  return out;
}

// The armed checks' verdict on this step (1 = non-finite), the same on every rank, in the record.
torch::Tensor StepPipeline::nonfinite_verdict(const torch::Tensor& grad_flag) {
  StepRecord& rec = current_;
  if (guard_.check_grads) rec.grad_nonfinite = grad_flag;
  if (guard_.check_loss) rec.loss_nonfinite = loss_flag_;
  torch::Tensor loss_verdict = loss_flag_;
  if (guard_.check_loss && strategy_) {
    // Every rank joins the reduction, also one whose micro-batches logged no loss.
    loss_verdict = loss_flag_.defined() ? loss_flag_.clone() : torch::zeros({}, sticky_.options());
    strategy_->reduce_max(loss_verdict, distributed::CollectiveKind::kLossAgreement);
  }
  torch::Tensor verdict;
  if (guard_.check_grads) verdict = max_defined(verdict, grad_flag);
  if (guard_.check_loss) verdict = max_defined(verdict, loss_verdict);
  rec.nonfinite = verdict;
  return verdict;
}

// Spikes: the step's loss (averaged over ranks so every rank decides alike) and the total norm of
// the (already reduced) gradients, unscaled under 16-mixed: [loss, grad norm].
torch::Tensor StepPipeline::spike_values(const torch::Tensor& total_norm) {
  const StepRecord& rec = current_;
  auto zero = torch::zeros({}, sticky_.options());
  torch::Tensor loss_value = zero;
  if (guard_.spike.loss && !rec.losses.empty()) {
    std::vector<torch::Tensor> ls;
    for (const auto& l : rec.losses) ls.push_back(l.to(torch::kFloat32).reshape({}));
    loss_value = torch::stack(ls).mean();
    if (strategy_ && strategy_->world_size() > 1) {
      loss_value = loss_value.clone();
      strategy_->reduce_sum(loss_value, distributed::CollectiveKind::kLossSum);
      loss_value = loss_value / static_cast<double>(strategy_->world_size());
    }
  }
  torch::Tensor norm_value = zero;
  if (guard_.spike.grad_norm && total_norm.defined())
    norm_value = scaler_ ? total_norm * scaler_->scale_tensor().reciprocal() : total_norm;
  return torch::stack({loss_value, norm_value.to(torch::kFloat32)});
}

// What the optimizer multiplies the gradients by: 1 / loss scale, times the clipping coefficient.
// Clipping by value rewrites the gradients in place instead (it needs unscaled values).
torch::Tensor StepPipeline::gradient_multiplier(std::vector<torch::Tensor>& grads, const torch::Tensor& total_norm) {
  const double clip = cfg_.gradient_clip_val;
  const bool clip_norm = clip > 0 && cfg_.gradient_clip_algorithm == "norm";
  const bool clip_value = clip > 0 && cfg_.gradient_clip_algorithm == "value";
  torch::Tensor multiplier;
  if (scaler_) multiplier = scaler_->scale_tensor().reciprocal();
  if (clip_norm && total_norm.defined()) {
    auto norm = multiplier.defined() ? total_norm * multiplier : total_norm;
    auto coef = (clip / (norm + 1e-6)).clamp_max(1.0);
    multiplier = multiplier.defined() ? multiplier * coef : coef;
  }
  if (clip_value && !grads.empty()) {
    // Clamping needs unscaled values: the one case where the gradients are rewritten in place.
    if (multiplier.defined()) at::_foreach_mul_(grads, multiplier), multiplier = torch::Tensor();
    at::_foreach_clamp_min_(grads, -clip);
    at::_foreach_clamp_max_(grads, clip);
  }
  return multiplier;
}

// The update, unless `skip` (our fused optimizers skip on the device; torch::optim reads the flag).
void StepPipeline::apply(std::vector<torch::Tensor>& grads, const torch::Tensor& skip, const torch::Tensor& multiplier) {
#if STROBE_HAS_OPS
  if (auto* f = dynamic_cast<ops::FusedOptimizerBase*>(&optimizer_)) {
    if (skip.defined()) f->set_found_nonfinite(skip);
    if (multiplier.defined()) f->set_grad_multiplier(multiplier);
    if (masters_) masters_->attach_grads(/*fp32_copies=*/false);  // the kernels read bf16 gradients
    optimizer_.step();
    if (masters_) masters_->copy_to_model();
    if (shards_) shards_->gather_params();
    return;
  }
#endif
  if (multiplier.defined() && !grads.empty()) at::_foreach_mul_(grads, multiplier);
  // torch::optim cannot skip on the device: the documented host read of this path.
  if (skip.defined() && skip.item<float>() != 0.0f) return;
  if (masters_) masters_->attach_grads(/*fp32_copies=*/true);
  if (shards_)  // torch::optim wants the parameters' dtype: bf16 gradient shards become fp32 copies
    for (auto& p : params_)
      if (p.grad().defined() && p.grad().scalar_type() != p.scalar_type()) p.mutable_grad() = p.grad().to(p.scalar_type());
  optimizer_.step();
  if (masters_) masters_->copy_to_model();
  if (shards_) shards_->gather_params();
}

void StepPipeline::step() {
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> grads;
  std::vector<size_t> with_grad;
  grads.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& g = params_[i].grad();
    if (g.defined()) grads.push_back(g), with_grad.push_back(i);
  }
  const bool clip_norm = cfg_.gradient_clip_val > 0 && cfg_.gradient_clip_algorithm == "norm";
  const bool spike_armed = guard_.spike.armed() && spike_window_.defined();
  GradPass pass;
  if ((guard_.check_grads || clip_norm || scaler_ || (spike_armed && guard_.spike.grad_norm)) && !grads.empty())
    pass = grad_pass(grads, with_grad, clip_norm || spike_armed);

  // The skip flag: the verdict, an overflow under 16-mixed (the loss scaler's business: skip and back
  // off), a spike, the sticky guard.
  const torch::Tensor verdict = nonfinite_verdict(pass.nonfinite);
  torch::Tensor skip = verdict;
  if (scaler_) skip = max_defined(skip, pass.nonfinite);
  torch::Tensor values, to_stick;
  if (spike_armed) {
    values = spike_values(pass.total_norm);
    skip = max_defined(skip, spike_verdict(values));
    to_stick = current_.spike_limit;
  }
  if (guard_.sticky) to_stick = max_defined(to_stick, verdict);
  if ((guard_.sticky || spike_armed) && sticky_.defined()) {
    if (to_stick.defined()) sticky_.copy_(torch::maximum(sticky_, to_stick));
    skip = max_defined(skip, sticky_.clone());
  }
  current_.skipped = skip;
  if (spike_armed) accept_spike_values(values, skip);

  apply(grads, skip, gradient_multiplier(grads, pass.total_norm));
  if (scaler_) scaler_->update(pass.nonfinite.defined() ? pass.nonfinite : torch::zeros({}, scaler_->scale_tensor().options()));
  if (guard_.restore_buffers && skip.defined() && !current_.buffers_before.empty()) restore_buffers(current_.buffers_before, skip);
  last_ = std::move(current_);
  current_ = StepRecord{};
}

void StepPipeline::save(checkpoint::CheckpointData& d, const StepStart* at) {
  if (!sticky_.defined()) return;
  d.tensors["step/sticky"] = at ? torch::zeros_like(sticky_) : sticky_;
  // The spike window: a capture (StepStart) is written while the guard is sticky, so no step since
  // the captured one has entered it: the live window is the one from that step's start.
  if (spike_window_.defined()) {
    d.tensors["step/spike/window"] = spike_window_;
    d.tensors["step/spike/count"] = spike_count_;
    d.tensors["step/spike/pos"] = spike_pos_;
    d.tensors["step/spike/consecutive"] = at ? torch::zeros_like(spike_consecutive_) : spike_consecutive_;
  }
}

void StepPipeline::load(const checkpoint::CheckpointData& d) {
  spike_loaded_.clear();
  const char* keys[] = {"window", "count", "pos", "consecutive"};
  for (const char* k : keys) {
    auto it = d.tensors.find(std::string("step/spike/") + k);
    if (it == d.tensors.end()) {
      spike_loaded_.clear();
      return;
    }
    spike_loaded_[k] = it->second;
  }
  const auto& c = spike_loaded_.at("count");
  const auto& p = spike_loaded_.at("pos");
  if (c.numel() != 1 || p.numel() != 1 || p.scalar_type() != torch::kLong || spike_loaded_.at("consecutive").numel() != 1)
    throw checkpoint::CheckpointError("the step guard's spike state (step/spike/*) has the wrong shapes");
  if (spike_window_.defined()) init_spike_state();  // armed before the load: apply it now
}

}  // namespace strobe
