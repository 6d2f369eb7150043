#include "strobe/core/fp8.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>

#include "strobe/core/optim.h"
#include "strobe/ops/ops.h"

#ifdef STROBE_TORCH_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace strobe {
namespace {

// The marked layers (a count each: two trainers may hold one model) and the live selections by
// their model. Read on every linear call, written when a trainer is built or let go.
struct Marks {
  std::shared_mutex mutex;
  std::atomic<size_t> count{0};  // layers.size(): read without the lock on every linear call
  std::unordered_map<const torch::nn::Module*, int> layers;
  std::unordered_map<const torch::nn::Module*, const Fp8Layers*> by_net;
};
Marks& marks() {
  static Marks m;
  return m;
}

// "layers.12.mlp.down_proj" -> "layers.*.mlp.down_proj": the path with its list indices as `*`.
std::string pattern_of(const std::string& path) {
  std::string out;
  size_t i = 0;
  while (i < path.size()) {
    const size_t end = std::min(path.find('.', i), path.size());
    const std::string part = path.substr(i, end - i);
    out += !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit) ? "*" : part;
    if (end < path.size()) out += '.';
    i = end + 1;
  }
  return out;
}

}  // namespace

bool fp8_marked(const torch::nn::Module& layer) {
  auto& m = marks();
  if (m.count.load(std::memory_order_acquire) == 0) return false;  // no trainer.fp8 run: no lock
  std::shared_lock lock(m.mutex);
  return m.layers.count(&layer) > 0;
}

at::Tensor linear_in_fp8(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& x_amax) {
  const auto device_type = x.device().type();
  if (!at::autocast::is_autocast_enabled(device_type)) return ops::fp8_linear(x, weight, bias, x_amax);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  const bool cast = x.scalar_type() != dt;
  const at::Tensor xc = cast ? x.to(dt) : x;
  const std::optional<at::Tensor> bc = bias ? std::optional<at::Tensor>(bias->to(dt)) : std::nullopt;
  // The op's own casts and GEMMs are what they are without autocast (its ATen calls would otherwise be
  // autocast's to rewrite). A cast x has another amax (its rounded values): the op finds it.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return ops::fp8_linear(xc, weight, bc, cast ? std::nullopt : x_amax);
}

std::tuple<at::Tensor, at::Tensor> linear_swiglu_in_fp8(const at::Tensor& x, const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& x_amax) {
  const auto device_type = x.device().type();
  if (!at::autocast::is_autocast_enabled(device_type)) return ops::fp8_linear_swiglu(x, weight, x_amax);
  const auto dt = at::autocast::get_autocast_dtype(device_type);
  const bool cast = x.scalar_type() != dt;
  const at::Tensor xc = cast ? x.to(dt) : x;
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return ops::fp8_linear_swiglu(xc, weight, cast ? std::nullopt : x_amax);
}

at::Tensor linear(const torch::nn::Linear& layer, const at::Tensor& x, const std::optional<at::Tensor>& x_amax) {
  const std::optional<at::Tensor> bias = layer->bias.defined() ? std::optional<at::Tensor>(layer->bias) : std::nullopt;
  return fp8_marked(*layer) ? linear_in_fp8(x, layer->weight, bias, x_amax) : at::linear(x, layer->weight, bias);
}

std::vector<Fp8Choice> select_fp8_layers(const torch::nn::Module& net, const std::vector<std::string>& capable,
                                         const config::Fp8Config& cfg, const std::string& model_name) {
  if (capable.empty())
    throw config::ConfigError(fmt::format(
        "trainer.fp8: model '{}' declares no linear layers that run in float8 (llama, vit and decoder_lm do)", model_name));
  std::vector<Fp8Choice> out;
  std::vector<bool> skip_used(cfg.skip.size(), false);
  for (const auto& item : net.named_modules("", /*include_self=*/false)) {
    const auto* lin = item.value()->as<torch::nn::Linear>();
    if (!lin) continue;
    const std::string& path = item.key();
    if (std::none_of(capable.begin(), capable.end(), [&](const std::string& g) { return glob_matches(g, path); })) continue;
    Fp8Choice c;
    c.path = path;
    c.layer = item.value().get();
    c.out_features = lin->weight.size(0);
    c.in_features = lin->weight.size(1);
    for (size_t i = 0; i < cfg.skip.size(); ++i)
      if (glob_matches(cfg.skip[i], path)) skip_used[i] = true, c.why_not = "skip";
    if (c.why_not.empty() && (c.out_features % 16 != 0 || c.in_features % 16 != 0)) c.why_not = "not a multiple of 16";
    if (c.why_not.empty() && c.out_features * c.in_features < cfg.min_size) c.why_not = "below min_size";
    c.fp8 = c.why_not.empty();
    out.push_back(std::move(c));
  }
  if (out.empty())
    throw config::ConfigError(fmt::format("trainer.fp8: model '{}' has no linear layer at the paths it declares for float8",
                                          model_name));
  for (size_t i = 0; i < cfg.skip.size(); ++i)
    if (!skip_used[i])
      throw config::ConfigError(fmt::format(
          "trainer.fp8.skip: '{}' matches none of the {} float8-capable linear layers of model '{}' (e.g. {})",
          cfg.skip[i], out.size(), model_name, out.front().path));
  if (std::none_of(out.begin(), out.end(), [](const Fp8Choice& c) { return c.fp8; })) {
    const auto largest = std::max_element(out.begin(), out.end(), [](const Fp8Choice& a, const Fp8Choice& b) {
      return a.out_features * a.in_features < b.out_features * b.in_features;
    });
    throw config::ConfigError(fmt::format(
        "trainer.fp8: no linear layer of model '{}' runs in float8: of its {} float8-capable layers the largest, {} "
        "({} x {} = {} elements), is {} (trainer.fp8.min_size is {}; 0 puts every capable layer in float8)",
        model_name, out.size(), largest->path, largest->out_features, largest->in_features,
        largest->out_features * largest->in_features, largest->why_not, cfg.min_size));
  }
  return out;
}

bool fp8_runs_under(Precision precision) {
  return precision == Precision::kBf16Master || precision == Precision::kBf16Mixed;
}

void check_fp8_run(Precision precision, const torch::Device& device) {
  if (!fp8_runs_under(precision))
    throw config::ConfigError(fmt::format(
        "trainer.fp8: needs trainer.precision bf16-master or bf16-mixed (the float8 GEMMs' outputs are bf16), got {}",
        to_string(precision)));
  if (!device.is_cuda()) return;
#ifdef STROBE_TORCH_HAS_CUDA
  const auto* p = at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index());
  const std::string refusal = fp8_device_refusal(device.str(), p->name, p->major, p->minor);
  if (!refusal.empty()) throw config::ConfigError(refusal);
#endif
}

std::string fp8_device_refusal(const std::string& device, const std::string& name, int major, int minor) {
  if (major * 10 + minor >= 89) return "";
  return fmt::format("trainer.fp8: device {} ({}) has compute capability {}.{}; float8 GEMMs need 8.9 (Ada) or 9.0+ (Hopper)",
                     device, name, major, minor);
}

Fp8Layers::Fp8Layers(const torch::nn::Module& net, std::vector<Fp8Choice> choices) : net_(&net), choices_(std::move(choices)) {
  auto& m = marks();
  std::unique_lock lock(m.mutex);
  for (const auto& c : choices_)
    if (c.fp8) ++m.layers[c.layer];
  m.count.store(m.layers.size(), std::memory_order_release);
  m.by_net[net_] = this;
}

Fp8Layers::~Fp8Layers() {
  auto& m = marks();
  std::unique_lock lock(m.mutex);
  for (const auto& c : choices_)
    if (c.fp8 && --m.layers[c.layer] <= 0) m.layers.erase(c.layer);
  m.count.store(m.layers.size(), std::memory_order_release);
  if (auto it = m.by_net.find(net_); it != m.by_net.end() && it->second == this) m.by_net.erase(it);
}

std::string Fp8Layers::summary() const {
  // Each (pattern, reason kept) once, in model order, with how many layers it covers.
  struct Group {
    std::string pattern, why_not;
    int count;
  };
  std::vector<Group> in, out;
  int n = 0;
  for (const auto& c : choices_) {
    n += c.fp8;
    auto& v = c.fp8 ? in : out;
    const std::string p = pattern_of(c.path);
    auto it = std::find_if(v.begin(), v.end(), [&](const Group& g) { return g.pattern == p && g.why_not == c.why_not; });
    if (it == v.end()) v.push_back({p, c.why_not, 1});
    else ++it->count;
  }
  auto list = [](const std::vector<Group>& v) {
    std::string s;
    for (const auto& g : v)
      s += (s.empty() ? "" : ", ") + g.pattern + (g.count > 1 ? fmt::format(" x{}", g.count) : "") +
           (g.why_not.empty() ? "" : " (" + g.why_not + ")");
    return s;
  };
  std::string s = fmt::format("{} of {} float8-capable linear layers in float8: {}", n, choices_.size(), list(in));
  if (!out.empty()) s += "; kept: " + list(out);
  return s;
}

std::string Fp8Layers::table() const {
  size_t w = 5;
  for (const auto& c : choices_) w = std::max(w, c.path.size());
  std::string s = fmt::format("Float8 (trainer.fp8): {}\n{:<{}} | {:>14} | {}\n", summary(), "Layer", w, "out x in", "GEMMs");
  for (const auto& c : choices_)
    s += fmt::format("{:<{}} | {:>14} | {}\n", c.path, w, fmt::format("{} x {}", c.out_features, c.in_features),
                     c.fp8 ? "float8" : "bf16 (" + c.why_not + ")");
  return s;
}

const Fp8Layers* fp8_layers_of(const torch::nn::Module& net) {
  auto& m = marks();
  std::shared_lock lock(m.mutex);
  auto it = m.by_net.find(&net);
  return it == m.by_net.end() ? nullptr : it->second;
}

}  // namespace strobe
