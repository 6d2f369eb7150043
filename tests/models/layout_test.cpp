// The transformers' residual stream stays one contiguous [.., C] tensor and every Linear's bias is
// added inside its GEMM: each aten op of a forward + backward is observed through a RecordFunction
// callback. Two regressions this catches, both measured on an H200 (docs/PERFORMANCE.md):
//  - ViT's patch embedding as a transposed view: the [B, D, N] layout rode through every residual
//    add and LayerNorm input (38 ms of a 151 ms ViT-L step);
//  - nn::Linear's C++ forward on 3-D inputs: matmul, then a broadcast `+= bias` pass over every
//    output (15.6 ms of a ViT-L step, 19.5 ms of a padded LM step).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/record_function.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "strobe/data/collate_tokens.h"
#include "tests/models/model_test_util.h"

namespace strobe {
namespace {

using testing::build_model;

struct Observed {
  std::mutex mu;
  std::vector<std::string> violations;
  int64_t adds = 0, norms = 0;
  std::vector<int64_t> widths;  // last dims of the residual stream, qkv and the MLP's hidden layer
};
Observed* g_observed = nullptr;

std::string describe(const at::RecordFunction& fn) {
  std::string s = fn.name();
  for (const auto& v : fn.inputs()) {
    if (!v.isTensor()) continue;
    const auto& t = v.toTensor();
    s += " " + c10::str(t.sizes()) + (t.is_contiguous() ? "" : "(strided " + c10::str(t.strides()) + ")");
  }
  return s;
}

std::unique_ptr<at::ObserverContext> observe(const at::RecordFunction& fn) {
  const std::string name = fn.name();
  const bool add = name == "aten::add" || name == "aten::add_";
  const bool norm = name == "aten::native_layer_norm";
  if (!add && !norm) return nullptr;
  std::vector<at::Tensor> ts;
  for (const auto& v : fn.inputs())
    if (v.isTensor() && v.toTensor().defined()) ts.push_back(v.toTensor());
  std::lock_guard<std::mutex> lock(g_observed->mu);
  // Only the token-major activations count (the math attention's [B, H, S, S] scores are its own).
  const auto& w = g_observed->widths;
  auto activation = [&](const at::Tensor& t) { return t.dim() >= 2 && std::find(w.begin(), w.end(), t.size(-1)) != w.end(); };
  bool bad = false;
  for (const auto& t : ts) bad |= activation(t) && t.dim() >= 3 && !t.is_contiguous();  // a strided pass
  if (add && ts.size() == 2 && activation(ts[0]) && ts[0].dim() >= 3 && ts[1].dim() == 1) bad = true;  // bias outside the GEMM
  (add ? g_observed->adds : g_observed->norms) += 1;
  if (bad) g_observed->violations.push_back(describe(fn));
  return nullptr;
}

// Runs forward + backward of `m` on `batch`, returns what the callback saw.
void observe_step(Model& m, const Batch& batch, Observed& seen) {
  g_observed = &seen;
  auto handle = at::addGlobalCallback(at::RecordFunctionCallback(observe).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  auto out = m.forward(batch);
  out.to(torch::kFloat32).square().mean().backward();
  at::removeCallback(handle);
  g_observed = nullptr;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < 6; ++i) s += "\n  " + v[i];
  return s;
}

TEST(ModelLayout, ViTResidualStreamIsContiguousAndBiasesStayInTheGemm) {
  torch::manual_seed(0);
  auto m = build_model(
      "{name: vit, img_size: 32, patch_size: 8, embed_dim: 32, depth: 2, num_heads: 4, num_classes: 10, "
      "class_token: false, global_pool: avg, attention: math}");  // as configs/vit_l16.yaml
  Observed seen;
  seen.widths = {32, 96, 128};
  observe_step(*m, testing::image_batch(torch::randn({3, 3, 32, 32})), seen);
  EXPECT_GE(seen.adds, 4) << "the callback saw no residual adds: it observes nothing";
  EXPECT_GE(seen.norms, 5);
  EXPECT_TRUE(seen.violations.empty()) << seen.violations.size() << " strided or bias passes:" << joined(seen.violations);
}

using testing::token_samples;

TEST(ModelLayout, DecoderLMPaddedAndPackedKeepTheResidualStreamContiguous) {
  torch::manual_seed(1);
  auto m = build_model("{name: decoder_lm, vocab_size: 50, max_seq_len: 16, embed_dim: 32, depth: 2, num_heads: 4, attention: math}");
  auto samples = token_samples({3, 7, 1, 12}, 50);
  for (const auto& batch : {data::collate_tokens_padded(samples, 16), data::collate_tokens_packed(samples)}) {
    Observed seen;
    seen.widths = {32, 96, 128};
    observe_step(*m, batch, seen);
    EXPECT_GE(seen.adds, 4);
    EXPECT_GE(seen.norms, 4);
    EXPECT_TRUE(seen.violations.empty()) << seen.violations.size() << " strided or bias passes:" << joined(seen.violations);
  }
}

}  // namespace
}  // namespace strobe
