#include "strobe/core/forensics.h"

#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <unordered_map>

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace strobe {

namespace {

std::atomic<bool> g_tracing{false};
thread_local std::vector<const char*> t_scopes;
// Per thread: nesting depth of observed ops, and the forward module of each backward function
// being evaluated (innermost last).
thread_local int t_depth = 0;
thread_local bool t_busy = false;
struct BackwardFrame {
  int depth;
  std::string module;
  std::string forward_op;
};
thread_local std::vector<BackwardFrame> t_backward;
// Open activation-checkpoint recomputes (innermost last): the backward frames and the op depth
// when each began; ops at that frame count are the recomputed block's forward ops.
struct RecomputeFrame {
  size_t frames;
  int depth;
};
thread_local std::vector<RecomputeFrame> t_recompute;

bool is_uninitialized_factory(const std::string& name) {
  return name.find("empty") != std::string::npos || name == "aten::resize_" || name == "aten::set_";
}

void collect_tensors(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const auto& t : v.toTensorList()) out.push_back(t);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) collect_tensors(e, out);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) collect_tensors(e, out);
  }
}

bool checkable(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 && at::isFloatingType(t.scalar_type()) && !t.is_meta();
}

// at::isfinite of a floating tensor; a float8 one (fp8_linear's saved operands) is upcast first, as
// libtorch implements no isfinite for it (its NaN stays NaN; e4m3 has no infinity).
at::Tensor isfinite_of(const at::Tensor& t) {
  return at::isFloat8Type(t.scalar_type()) ? at::isfinite(t.to(at::kFloat)) : at::isfinite(t);
}

bool all_finite(const at::Tensor& t) { return !checkable(t) || isfinite_of(t).all().item<bool>(); }

}  // namespace

ModuleScope::ModuleScope(const char* path) : active_(g_tracing.load(std::memory_order_relaxed)) {
  if (active_) t_scopes.push_back(path);
}

ModuleScope::~ModuleScope() {
  if (active_) t_scopes.pop_back();
}

RecomputeScope::RecomputeScope() : active_(g_tracing.load(std::memory_order_relaxed)) {
  if (active_) t_recompute.push_back({t_backward.size(), t_depth});
}

RecomputeScope::~RecomputeScope() {
  if (active_) t_recompute.pop_back();
}

TensorStats tensor_stats(const torch::Tensor& t, std::string name) {
  TensorStats s;
  s.name = std::move(name);
  s.shape = t.sizes().vec();
  s.dtype = std::string(c10::toString(t.scalar_type()));
  s.numel = t.numel();
  if (s.numel == 0 || !at::isFloatingType(t.scalar_type())) return s;
  torch::NoGradGuard ng;
  auto x = t.detach().to(torch::kCPU, torch::kDouble).reshape({-1});
  s.nan = x.isnan().sum().item<int64_t>();
  s.pos_inf = (x == std::numeric_limits<double>::infinity()).sum().item<int64_t>();
  s.neg_inf = (x == -std::numeric_limits<double>::infinity()).sum().item<int64_t>();
  auto finite = x.masked_select(x.isfinite());
  if (finite.numel() > 0) {
    s.min = finite.min().item<double>();
    s.max = finite.max().item<double>();
    s.mean_abs = finite.abs().mean().item<double>();
  }
  return s;
}

nlohmann::json TensorStats::to_json() const {
  return {{"name", name}, {"shape", shape}, {"dtype", dtype}, {"numel", numel},  {"nan", nan},
          {"pos_inf", pos_inf}, {"neg_inf", neg_inf}, {"min", min}, {"max", max}, {"mean_abs", mean_abs}};
}

nlohmann::json NonFiniteEvent::to_json() const {
  nlohmann::json in = nlohmann::json::array();
  for (const auto& s : inputs) in.push_back(s.to_json());
  return {{"op", op},         {"kernel", kernel}, {"module", module}, {"phase", phase}, {"note", note},
          {"inputs_finite", inputs_finite}, {"inputs", in}, {"output", output.to_json()},
          {"output_rows", output_rows}, {"nonfinite_rows", nonfinite_rows}};
}

struct NonFiniteTracer::Impl {
  std::unordered_map<const c10::TensorImpl*, std::string> param_module, param_name;
  std::mutex mu;
  // (creating thread, sequence number) of an autograd node -> (op, module)
  std::map<std::pair<uint64_t, int64_t>, std::pair<std::string, std::string>> forward_of_seq;
  std::string last_module;
  // Storages holding infinities the code meant (an attention mask's -inf, an LSE's +inf for a row
  // without keys), and what was computed from them without adding any: never a finding.
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> intended;
  std::optional<NonFiniteEvent> first;
  int64_t ops = 0;
  at::CallbackHandle handle = 0;
};

namespace {

NonFiniteTracer::Impl* g_impl = nullptr;

// The ops that write a constant: with an infinite value they build a mask (masked_fill of -inf over
// the scores a causal or padding mask hides, full_like of +inf for an LSE without keys).
bool is_fill_op(const std::string& name) {
  return name == "aten::full" || name == "aten::full_like" || name == "aten::new_full" || name == "aten::fill_" ||
         name == "aten::fill" || name == "aten::masked_fill" || name == "aten::masked_fill_";
}

bool holds_nan(const at::Tensor& t) { return checkable(t) && at::isnan(t).any().item<bool>(); }

bool is_intended(const NonFiniteTracer::Impl& impl, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return false;
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  auto it = impl.intended.find(s);
  return it != impl.intended.end() && it->second.lock().get() == s;
}

void mark_intended(NonFiniteTracer::Impl& impl, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return;
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  impl.intended.insert_or_assign(s, c10::weak_intrusive_ptr<c10::StorageImpl>(t.storage().getWeakStorageImpl()));
}

// Whether a non-finite `out` of op `name` holds only infinities the code meant: a fill op's infinite
// constant over finite inputs, or infinities that were already in an intended input at the same
// places (a mask added to the scores, the masked scores less their maximum, a copy or a view). Any
// NaN, or an infinity at a place no intended input had one, is a finding.
bool only_intended_infinities(const std::string& name, const at::Tensor& out, const std::vector<at::Tensor>& inputs,
                              const std::vector<bool>& finite, const std::vector<bool>& intended) {
  if (holds_nan(out)) return false;
  if (is_fill_op(name)) {
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].dim() > 0 && !finite[i] && !intended[i]) return false;  // a 0-d input: the fill value
    return true;
  }
  const at::Tensor out_inf = at::isinf(out.detach());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!intended[i]) continue;
    if (out.has_storage() && inputs[i].has_storage() && out.storage().is_alias_of(inputs[i].storage())) return true;  // a view
    if (!at::is_expandable_to(inputs[i].sizes(), out.sizes())) continue;
    // The input as it was (a copy for an in-place op), broadcast to the output: no new infinity.
    const at::Tensor in_inf = at::isinf(inputs[i]).expand(out.sizes());
    if (!(out_inf & in_inf.logical_not()).any().item<bool>()) return true;
  }
  return false;
}

struct OpContext : at::ObserverContext {
  std::string module, note, phase;
  bool check = false;
  bool backward_function = false;
  std::vector<at::Tensor> inputs;  // copies for in-place ops: their inputs are overwritten
  std::vector<std::string> input_names;
  std::vector<bool> input_finite;    // whether each input was finite (before an in-place op)
  std::vector<bool> input_intended;  // whether each input held intended infinities (likewise)
  bool inputs_finite = true;
  int64_t seq_begin = -1;  // a top-level forward op: the autograd sequence number when it began
  uint64_t thread = 0;      // and the thread it ran on
};

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  if (t_busy || g_impl == nullptr) return nullptr;
  t_busy = true;
  at::DisableRecordFunctionGuard no_record;
  auto ctx = std::make_unique<OpContext>();
  const int depth = t_depth++;
  const std::string name = fn.name();
  auto& impl = *g_impl;
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    ctx->backward_function = true;
    BackwardFrame frame{depth, "", name};
    {
      std::lock_guard<std::mutex> lock(impl.mu);
      auto it = impl.forward_of_seq.find({fn.forwardThreadId(), fn.seqNr()});
      if (it != impl.forward_of_seq.end()) frame.forward_op = it->second.first, frame.module = it->second.second;
    }
    t_backward.push_back(std::move(frame));
    t_busy = false;
    return ctx;
  }
  // A checkpoint's recompute: forward ops, top-level at the depth the recompute began.
  const bool recompute = !t_recompute.empty() && t_recompute.back().frames == t_backward.size();
  const int top = recompute ? t_recompute.back().depth : 0;
  const bool in_backward = !t_backward.empty() && !recompute;
  // Only the ops user code (or a backward formula) calls directly are checked: their outputs are
  // complete, while an implementation's inner ops may see buffers that are not yet written.
  ctx->check = in_backward ? depth == t_backward.back().depth + 1 : depth == top;
  if (ctx->check && is_uninitialized_factory(name)) ctx->check = false;
  std::vector<at::Tensor> inputs;
  for (const auto& v : fn.inputs()) collect_tensors(v, inputs);
  {
    std::lock_guard<std::mutex> lock(impl.mu);
    if (in_backward) {
      const auto& f = t_backward.back();
      ctx->phase = "backward";
      ctx->module = f.module;
      ctx->note = fmt::format("in the backward of {} ({})", f.forward_op, f.module.empty() ? "no module" : f.module);
    } else {
      ctx->phase = recompute ? "backward" : "forward";
      for (const auto& t : inputs) {
        if (!t.defined()) continue;
        auto it = impl.param_module.find(t.unsafeGetTensorImpl());
        if (it != impl.param_module.end()) {
          ctx->module = it->second;
          ctx->note = "owns a parameter input";
          break;
        }
      }
      if (ctx->module.empty() && !t_scopes.empty()) {
        ctx->module = t_scopes.back();
        ctx->note = "inside the declared scope";
      }
      if (ctx->module.empty() && !impl.last_module.empty()) {
        ctx->module = impl.last_module;
        ctx->note = fmt::format("no parameter input: follows {}", impl.last_module);
      }
      if (ctx->note == "owns a parameter input") impl.last_module = ctx->module;
      if (recompute) ctx->note += " (recomputed by an activation checkpoint)";
      if (depth == top && fn.seqNr() >= 0) impl.forward_of_seq[{fn.threadId(), fn.seqNr()}] = {name, ctx->module};
      if (depth == top) {
        ctx->seq_begin = static_cast<int64_t>(at::sequence_number::peek());
        ctx->thread = fn.threadId();
      }
    }
  }
  if (ctx->check) {
    const bool in_place = !name.empty() && name.back() == '_';
    size_t i = 0;
    for (const auto& t : inputs) {
      std::string label = fmt::format("input {}", i++);
      if (t.defined()) {
        auto it = impl.param_name.find(t.unsafeGetTensorImpl());
        if (it != impl.param_name.end()) label = fmt::format("{} (parameter {})", label, it->second);
      }
      if (!checkable(t)) continue;
      const bool finite = all_finite(t);
      if (!finite) ctx->inputs_finite = false;
      ctx->inputs.push_back(in_place ? t.detach().clone() : t.detach());
      ctx->input_names.push_back(label);
      ctx->input_finite.push_back(finite);
      bool intended = false;
      if (!finite) {  // only a non-finite input can hold a mask's infinities
        std::lock_guard<std::mutex> lock(impl.mu);
        intended = is_intended(impl, t);
      }
      ctx->input_intended.push_back(intended);
    }
  }
  t_busy = false;
  return ctx;
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
  auto* ctx = static_cast<OpContext*>(raw);
  if (ctx == nullptr || g_impl == nullptr) return;
  t_busy = true;
  at::DisableRecordFunctionGuard no_record;
  --t_depth;
  if (ctx->backward_function) {
    if (!t_backward.empty()) t_backward.pop_back();
    t_busy = false;
    return;
  }
  auto& impl = *g_impl;
  {
    std::lock_guard<std::mutex> lock(impl.mu);
    ++impl.ops;
    // Every autograd node a top-level forward op created (its own, those of the ops a composite or a
    // custom autograd Function runs inside it, whose numbers need not be the one the op began with)
    // belongs to that op: its backward is attributed to the op's module.
    if (ctx->seq_begin >= 0) {
      const auto end = static_cast<int64_t>(at::sequence_number::peek());
      for (int64_t q = ctx->seq_begin; q < end && q < ctx->seq_begin + 4096; ++q)
        impl.forward_of_seq.emplace(std::make_pair(ctx->thread, q), std::make_pair(std::string(fn.name()), ctx->module));
    }
    if (impl.first || !ctx->check) {
      t_busy = false;
      return;
    }
  }
  std::vector<at::Tensor> outputs;
  for (const auto& v : fn.outputs()) collect_tensors(v, outputs);
  for (const auto& out : outputs) {
    if (all_finite(out)) continue;
    {
      std::lock_guard<std::mutex> lock(impl.mu);
      if (only_intended_infinities(fn.name(), out, ctx->inputs, ctx->input_finite, ctx->input_intended)) {
        mark_intended(impl, out);
        continue;
      }
    }
    NonFiniteEvent e;
    e.op = e.kernel = fn.name();
    e.module = ctx->module.empty() ? "(no module)" : ctx->module;
    e.phase = ctx->phase;
    e.inputs_finite = ctx->inputs_finite;
    e.note = ctx->note;
    if (!ctx->inputs_finite) e.note += "; an input was already non-finite (it came from outside the traced ops)";
    for (size_t i = 0; i < ctx->inputs.size(); ++i) e.inputs.push_back(tensor_stats(ctx->inputs[i], ctx->input_names[i]));
    e.output = tensor_stats(out, "output");
    if (out.dim() >= 1 && out.size(0) > 0) {
      e.output_rows = out.size(0);
      auto bad = isfinite_of(out.detach()).logical_not().reshape({out.size(0), -1}).any(1).nonzero().reshape({-1}).to(torch::kCPU);
      const int64_t* p = bad.data_ptr<int64_t>();
      e.nonfinite_rows.assign(p, p + bad.numel());
    }
    std::lock_guard<std::mutex> lock(impl.mu);
    if (!impl.first) impl.first = std::move(e);
    break;
  }
  t_busy = false;
}

}  // namespace

NonFiniteTracer::NonFiniteTracer(torch::nn::Module& net) : impl_(std::make_unique<Impl>()) {
  for (const auto& m : net.named_modules("", /*include_self=*/false)) {
    for (const auto& p : m.value()->named_parameters(/*recurse=*/false)) {
      impl_->param_module[p.value().unsafeGetTensorImpl()] = m.key();
      impl_->param_name[p.value().unsafeGetTensorImpl()] = m.key() + "." + p.key();
    }
  }
  for (const auto& p : net.named_parameters(/*recurse=*/false)) {
    impl_->param_module[p.value().unsafeGetTensorImpl()] = "(root)";
    impl_->param_name[p.value().unsafeGetTensorImpl()] = p.key();
  }
  if (g_impl != nullptr) throw std::logic_error("NonFiniteTracer: one tracer at a time");
  g_impl = impl_.get();
  g_tracing.store(true);
  impl_->handle = at::addGlobalCallback(at::RecordFunctionCallback(&on_op_start, &on_op_end)
                                            .needsInputs(true)
                                            .needsOutputs(true)
                                            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

NonFiniteTracer::~NonFiniteTracer() {
  at::removeCallback(impl_->handle);
  g_tracing.store(false);
  g_impl = nullptr;
}

std::optional<NonFiniteEvent> NonFiniteTracer::first() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->first;
}

int64_t NonFiniteTracer::ops_observed() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->ops;
}

}  // namespace strobe
