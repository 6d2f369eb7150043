#include "strobe/core/step_pipeline.h"

#include <map>

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

void StepPipeline::arm(const StepGuard& g) { guard_ |= g; }

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

void StepPipeline::step() {
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> grads;
  std::vector<size_t> with_grad;
  grads.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& g = params_[i].grad();
    if (g.defined()) grads.push_back(g), with_grad.push_back(i);
  }
  const double clip = cfg_.gradient_clip_val;
  const bool clip_norm = clip > 0 && cfg_.gradient_clip_algorithm == "norm";
  const bool clip_value = clip > 0 && cfg_.gradient_clip_algorithm == "value";

  StepRecord& rec = current_;
  // The one pass over the gradients: per-gradient L2 norms give both the non-finite flag (a NaN or
  // Inf element makes its tensor's norm non-finite) and the total norm for clipping.
  torch::Tensor grad_flag, total_norm;
  if ((guard_.check_grads || clip_norm || scaler_) && !grads.empty()) {
    rec.grad_norms = torch::stack(at::_foreach_norm(grads, 2, torch::kFloat32));
    grad_flag = rec.grad_norms.isfinite().logical_not().any().to(torch::kFloat32);
    if (clip_norm) total_norm = torch::linalg_vector_norm(rec.grad_norms, 2);
    if (!grad_names_ || grad_names_->size() != with_grad.size()) {
      auto names = std::make_shared<std::vector<std::string>>();
      for (size_t i : with_grad) names->push_back(param_names_[i]);
      grad_names_ = std::move(names);
    }
    rec.grad_names = grad_names_;
  }
  if (guard_.check_grads) rec.grad_nonfinite = grad_flag;
  if (guard_.check_loss) rec.loss_nonfinite = loss_flag_;
  torch::Tensor loss_verdict = loss_flag_;
  if (guard_.check_loss && strategy_) {
    // Every rank joins the reduction, also one whose micro-batches logged no loss.
    loss_verdict = loss_flag_.defined() ? loss_flag_.clone() : torch::zeros({}, sticky_.options());
    strategy_->reduce_max(loss_verdict);
  }
  torch::Tensor verdict;
  if (guard_.check_grads) verdict = max_defined(verdict, grad_flag);
  if (guard_.check_loss) verdict = max_defined(verdict, loss_verdict);
  rec.nonfinite = verdict;

  torch::Tensor skip = verdict;
  // Under 16-mixed an overflowing gradient is the loss scaler's business: skip and back off.
  if (scaler_) skip = max_defined(skip, grad_flag);
  if (guard_.sticky && sticky_.defined()) {
    if (verdict.defined()) sticky_.copy_(torch::maximum(sticky_, verdict));
    skip = max_defined(skip, sticky_.clone());
  }
  rec.skipped = skip;

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

  bool applied = true;
#if STROBE_HAS_OPS
  if (auto* f = dynamic_cast<ops::FusedOptimizerBase*>(&optimizer_)) {
    if (skip.defined()) f->set_found_nonfinite(skip);
    if (multiplier.defined()) f->set_grad_multiplier(multiplier);
    if (masters_) masters_->attach_grads(/*fp32_copies=*/false);  // the kernels read bf16 gradients
    optimizer_.step();
    if (masters_) masters_->copy_to_model();
    applied = false;
  }
#endif
  if (applied) {
    if (multiplier.defined() && !grads.empty()) at::_foreach_mul_(grads, multiplier);
    // torch::optim cannot skip on the device: the documented host read of this path.
    if (!skip.defined() || skip.item<float>() == 0.0f) {
      if (masters_) masters_->attach_grads(/*fp32_copies=*/true);
      optimizer_.step();
      if (masters_) masters_->copy_to_model();
    }
  }
  if (scaler_) scaler_->update(grad_flag.defined() ? grad_flag : torch::zeros({}, scaler_->scale_tensor().options()));
  if (guard_.restore_buffers && skip.defined() && !rec.buffers_before.empty()) restore_buffers(rec.buffers_before, skip);
  last_ = std::move(current_);
  current_ = StepRecord{};
}

void StepPipeline::save(checkpoint::CheckpointData& d, const StepStart* at) {
  if (!sticky_.defined()) return;
  d.tensors["step/sticky"] = at ? torch::zeros_like(sticky_) : sticky_;
}

}  // namespace strobe
