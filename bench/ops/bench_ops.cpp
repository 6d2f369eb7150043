// C++ side of the ops benchmarks: the fused optimizer classes against torch::optim::AdamW (C++)
// on ViT-L/16's parameter shapes, and giou_loss fwd / fwd+bwd called from C++ (no Python
// overhead). Wall-clock over many back-to-back iterations with a device sync at both ends.
//   cmake --build build --target bench_ops && build/bin/bench_ops [iters]
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "framework/ops/fused_optimizers.h"
#include "framework/ops/ops.h"

namespace {

std::vector<std::vector<int64_t>> vit_l16_shapes() {
  const int64_t d = 1024, mlp = 4096;
  std::vector<std::vector<int64_t>> s{{d, 3, 16, 16}, {d}, {1, 1, d}, {1, 197, d}};
  for (int i = 0; i < 24; ++i) {
    for (auto x : std::vector<std::vector<int64_t>>{{d}, {d}, {3 * d, d}, {3 * d}, {d, d}, {d}, {d}, {d}, {mlp, d}, {mlp}, {d, mlp}, {d}}) {
      s.push_back(x);
    }
  }
  for (auto x : std::vector<std::vector<int64_t>>{{d}, {d}, {1000, d}, {1000}}) s.push_back(x);
  return s;
}

template <typename F>
double time_ms(F&& f, int iters) {
  for (int i = 0; i < 3; ++i) f();
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
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

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::printf("bench_ops: no CUDA device\n");
    return 0;
  }
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const auto opts = torch::optim::AdamWOptions(1e-4).weight_decay(0.05);
  int64_t numel = 0;
  for (const auto& s : vit_l16_shapes()) numel += c10::multiply_integers(s);
  std::printf("ViT-L/16: %lld params in %zu tensors\n", static_cast<long long>(numel), vit_l16_shapes().size());
  {
    auto ps = make_params(torch::kFloat);
    torch::optim::AdamW ref(ps, opts);
    std::printf("torch::optim::AdamW (C++)            %8.3f ms/step\n", time_ms([&] { ref.step(); }, iters));
  }
  for (auto gd : {torch::kFloat, torch::kBFloat16}) {
    auto ps = make_params(gd);
    strobe::ops::FusedAdamW fused(ps, opts);
    const auto found = torch::zeros({}, torch::kCUDA);
    std::printf("strobe::ops::FusedAdamW %-13s %8.3f ms/step\n", gd == torch::kFloat ? "fp32 grads" : "bf16 grads",
                time_ms([&] { fused.set_found_nonfinite(found); fused.step(); }, iters));
  }
  // GIoU B=1024, N=256 (a few valid targets per image as in the baseline's make_boxes).
  const int64_t b = 1024, n = 256;
  auto tl = torch::randint(0, 255, {b, n, 2}).to(torch::kFloat);
  auto count = torch::clamp(torch::floor(torch::abs(torch::randn({b}) * 3)), 0, 255);
  auto valid = (torch::arange(n).unsqueeze(0) < count.unsqueeze(1)).unsqueeze(-1);
  auto target = (torch::cat({tl, torch::clamp(tl + torch::randint(1, 256, {b, n, 2}), 0, 255)}, -1) * valid).to(torch::kCUDA);
  auto ptl = torch::rand({b, n, 2}) * 200;
  auto pred0 = torch::cat({ptl, ptl + 1 + torch::rand({b, n, 2}) * 50}, -1);
  for (auto dt : {torch::kFloat, torch::kBFloat16}) {
    auto pred = pred0.to(torch::kCUDA, dt).requires_grad_(true);
    const char* tag = dt == torch::kFloat ? "fp32" : "bf16";
    const int giters = 200;
    {
      torch::NoGradGuard ng;
      std::printf("giou_loss %s fwd                     %8.2f us\n", tag,
                  1e3 * time_ms([&] { strobe::ops::giou_loss(pred, target); }, giters));
    }
    std::printf("giou_loss %s fwd+bwd                 %8.2f us\n", tag,
                1e3 * time_ms([&] { torch::autograd::grad({strobe::ops::giou_loss(pred, target)}, {pred}); }, giters));
  }
  return 0;
}
