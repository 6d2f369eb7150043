// The kernel suites (CUDA only): giou (strobe::giou fwd, fwd+bwd on the seed's detector shapes),
// optimizer (the fused multi-tensor optimizers against torch::optim on ViT-L/16's parameter
// shapes) and attention (strobe::flash_attention against ATen's scaled_dot_product_attention on
// the shapes of issue 13's table). Each call is timed on its own between two CUDA events after a
// warm-up (host launch overhead included, as in bench/pytorch_baselines.py).
#include <fmt/format.h>
#include <torch/torch.h>

#include "bench/lib/bench.h"
#include "strobe/ops/fused_optimizers.h"
#include "strobe/ops/ops.h"

namespace strobe::bench {
namespace {

const char* kNeedsCuda = "needs a CUDA device (it times our CUDA kernels)";

int64_t reps(const SuiteOptions& o, int64_t def) { return o.steps > 0 ? o.steps : def; }
int64_t warm(const SuiteOptions& o, int64_t def) { return o.warmup >= 0 ? o.warmup : def; }

nlohmann::json row(const std::string& name, const std::vector<double>& ms, const std::string& note = "") {
  nlohmann::json j = {{"name", name}, {"ms", to_json(summarize(ms))}};
  if (!note.empty()) j["note"] = note;
  return j;
}

std::vector<std::vector<int64_t>> vit_l16_shapes() {
  const int64_t d = 1024, mlp = 4096;
  std::vector<std::vector<int64_t>> s{{d, 3, 16, 16}, {d}, {1, 1, d}, {1, 197, d}};
  for (int i = 0; i < 24; ++i)
    for (auto x : std::vector<std::vector<int64_t>>{{d}, {d}, {3 * d, d}, {3 * d}, {d, d}, {d}, {d}, {d}, {mlp, d}, {mlp}, {d, mlp}, {d}})
      s.push_back(x);
  for (auto x : std::vector<std::vector<int64_t>>{{d}, {d}, {1000, d}, {1000}}) s.push_back(x);
  return s;
}

std::vector<torch::Tensor> make_params(torch::Dtype grad_dtype) {
  torch::manual_seed(0);
  std::vector<torch::Tensor> ps;
  for (const auto& s : vit_l16_shapes()) {
    auto p = (torch::randn(s, torch::kCUDA) * 0.02).requires_grad_(true);
    p.mutable_grad() = (torch::randn(s, torch::kCUDA) * 1e-3).to(grad_dtype);
    ps.push_back(p);
  }
  return ps;
}

}  // namespace

nlohmann::json optimizer_suite(const SuiteOptions& o) {
  if (!o.cuda) return skipped("optimizer", kNeedsCuda);
  const torch::Device dev(torch::kCUDA);
  const int64_t w = warm(o, 5), n = reps(o, 50);
  const auto opts = torch::optim::AdamWOptions(1e-4).weight_decay(0.05);
  nlohmann::json out = {{"status", "ok"}, {"workloads", nlohmann::json::array()}};
  const std::string shapes = fmt::format("ViT-L/16 params ({} tensors)", vit_l16_shapes().size());
  {
    auto ps = make_params(torch::kFloat);
    torch::optim::AdamW ref(ps, opts);
    out["workloads"].push_back(row("torch::optim::AdamW", time_calls([&] { ref.step(); }, w, n, dev), shapes));
  }
  for (auto gd : {torch::kFloat, torch::kBFloat16}) {
    auto ps = make_params(gd);
    ops::FusedAdamW fused(ps, opts);
    const auto found = torch::zeros({}, torch::kCUDA);
    out["workloads"].push_back(row(fmt::format("FusedAdamW {} grads", gd == torch::kFloat ? "fp32" : "bf16"),
                                   time_calls([&] { fused.set_found_nonfinite(found); fused.step(); }, w, n, dev),
                                   shapes));
  }
  {
    auto ps = make_params(torch::kFloat);
    torch::optim::SGD ref(ps, torch::optim::SGDOptions(1e-3).momentum(0.9));
    out["workloads"].push_back(row("torch::optim::SGD momentum", time_calls([&] { ref.step(); }, w, n, dev), shapes));
    auto ps2 = make_params(torch::kFloat);
    ops::FusedSGD fused(ps2, torch::optim::SGDOptions(1e-3).momentum(0.9));
    out["workloads"].push_back(row("FusedSGD momentum", time_calls([&] { fused.step(); }, w, n, dev), shapes));
  }
  return out;
}

nlohmann::json giou_suite(const SuiteOptions& o) {
  if (!o.cuda) return skipped("giou", kNeedsCuda);
  const torch::Device dev(torch::kCUDA);
  const int64_t w = warm(o, 10), n = reps(o, 100);
  // B=1024 images, N=256 slots, a few valid targets per image (the seed's make_boxes).
  torch::manual_seed(0);
  const int64_t b = 1024, slots = 256;
  auto tl = torch::randint(0, 255, {b, slots, 2}).to(torch::kFloat);
  auto count = torch::clamp(torch::floor(torch::abs(torch::randn({b}) * 3)), 0, 255);
  auto valid = (torch::arange(slots).unsqueeze(0) < count.unsqueeze(1)).unsqueeze(-1);
  auto target = (torch::cat({tl, torch::clamp(tl + torch::randint(1, 256, {b, slots, 2}), 0, 255)}, -1) * valid).to(dev);
  auto ptl = torch::rand({b, slots, 2}) * 200;
  auto pred0 = torch::cat({ptl, ptl + 1 + torch::rand({b, slots, 2}) * 50}, -1);
  nlohmann::json out = {{"status", "ok"}, {"workloads", nlohmann::json::array()}};
  for (auto dt : {torch::kFloat, torch::kBFloat16}) {
    auto pred = pred0.to(dev, dt).requires_grad_(true);
    const std::string tag = fmt::format("giou B{} N{} {}", b, slots, dt == torch::kFloat ? "fp32" : "bf16");
    {
      torch::NoGradGuard ng;
      out["workloads"].push_back(row(tag + " fwd", time_calls([&] { ops::giou(pred, target); }, w, n, dev)));
    }
    out["workloads"].push_back(row(
        tag + " fwd+bwd", time_calls([&] { torch::autograd::grad({ops::giou(pred, target)}, {pred}); }, w, n, dev)));
  }
  return out;
}

nlohmann::json attention_suite(const SuiteOptions& o) {
  if (!o.cuda) return skipped("attention", kNeedsCuda);
  const torch::Device dev(torch::kCUDA);
  const int64_t w = warm(o, 10), n = reps(o, 50);
  struct Shape {
    const char* name;
    int64_t b, h, s, d;
    bool causal;
  };
  const Shape shapes[] = {{"vit b128 s196 h16 d64", 128, 16, 196, 64, false},
                          {"lm b32 s1024 h16 d64 causal", 32, 16, 1024, 64, true},
                          {"long b8 s3136 h12 d64", 8, 12, 3136, 64, false}};
  nlohmann::json out = {{"status", "ok"}, {"workloads", nlohmann::json::array()}};
  const auto bf16 = torch::TensorOptions().device(dev).dtype(torch::kBFloat16);
  for (const auto& sh : shapes) {
    const double flops = 4.0 * sh.b * sh.h * sh.s * sh.s * sh.d / (sh.causal ? 2.0 : 1.0);
    auto tflops = [&](const std::vector<double>& ms, double mult) {
      return fmt::format("{:.1f} TFLOP/s", mult * flops / summarize(ms).median / 1e9);
    };
    torch::manual_seed(0);
    // Ours takes [B, S, H, D]; SDPA [B, H, S, D]: each gets its native layout (no copies timed).
    auto q = torch::randn({sh.b, sh.s, sh.h, sh.d}, bf16).requires_grad_(true);
    auto k = torch::randn({sh.b, sh.s, sh.h, sh.d}, bf16).requires_grad_(true);
    auto v = torch::randn({sh.b, sh.s, sh.h, sh.d}, bf16).requires_grad_(true);
    auto dout = torch::randn({sh.b, sh.s, sh.h, sh.d}, bf16);
    auto ours = [&] { return std::get<0>(ops::flash_attention(q, k, v, sh.causal)); };
    std::vector<double> f, fb;
    {
      torch::NoGradGuard ng;
      f = time_calls([&] { ours(); }, w, n, dev);
    }
    fb = time_calls([&] { ours().backward(dout); }, w, n, dev);
    out["workloads"].push_back(row(fmt::format("{} strobe fwd", sh.name), f, tflops(f, 1.0)));
    out["workloads"].push_back(row(fmt::format("{} strobe fwd+bwd", sh.name), fb, tflops(fb, 3.5)));
    auto qt = q.detach().transpose(1, 2).contiguous().requires_grad_(true);
    auto kt = k.detach().transpose(1, 2).contiguous().requires_grad_(true);
    auto vt = v.detach().transpose(1, 2).contiguous().requires_grad_(true);
    auto dt = dout.transpose(1, 2).contiguous();
    auto sdpa = [&] { return at::scaled_dot_product_attention(qt, kt, vt, {}, 0.0, sh.causal); };
    {
      torch::NoGradGuard ng;
      f = time_calls([&] { sdpa(); }, w, n, dev);
    }
    fb = time_calls([&] { sdpa().backward(dt); }, w, n, dev);
    out["workloads"].push_back(row(fmt::format("{} ATen sdpa fwd", sh.name), f, tflops(f, 1.0)));
    out["workloads"].push_back(row(fmt::format("{} ATen sdpa fwd+bwd", sh.name), fb, tflops(fb, 3.5)));
  }
  return out;
}

}  // namespace strobe::bench
