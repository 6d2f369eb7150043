// strobe_model_check MODEL_YAML [REFERENCE.pt]
// strobe_model_check MODEL_YAML --logits IN.safetensors OUT.safetensors [--device DEVICE]
// Builds the model described by MODEL_YAML (a `model:` section as YAML text) and prints one JSON line:
//   {"parameters": N}                                                 without a reference;
//   {"parameters": N, "max_abs_diff": d, "max_abs_expected": m, ...} with one.
// The reference is a TorchScript module with attributes `weights` (Dict[str, Tensor], keyed by
// Strobe's parameter/buffer names), `input` and `expected` (the reference network's eval output).
// Every parameter and buffer must be present with the same shape, and every weight used: a naming
// or shape mismatch is an error (exit 1) listing the offending names.
// --logits: the model's `init_from` is loaded as `strobe fit` loads it (runner/init_from.h), and the
// eval-mode output for IN's batch ("image", or "tokens" with "position_ids", and "cu_seqlens" when
// packed) is written to OUT as "logits" (tests/python/test_pretrained.py compares it with timm's and
// torchvision's, test_hf_llama.py with transformers'), computed on DEVICE (default cpu: e.g. cuda),
// with the model's declared training FLOPs for that batch as "training_flops" (a float64 scalar).
// A config error is one line, exit 2.
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/script.h>
#include <torch/torch.h>

#include "strobe/checkpoint/safetensors.h"
#include "strobe/config/config.h"
#include "strobe/config/experiment.h"
#include "strobe/core/model.h"
#include "runner/init_from.h"

namespace {

int write_logits(const std::string& yaml, const std::string& in, const std::string& out, const torch::Device& device) {
  auto doc = strobe::config::Document::load_string(yaml, "model");
  auto section = doc.root();
  const auto init_from = strobe::config::parse_init_from(section);
  auto model = strobe::model_registry().create(section, "");
  if (init_from) strobe::load_init_from(*model, section, *init_from, false);
  model->to(device);
  model->eval();
  torch::NoGradGuard guard;
  strobe::Batch batch;
  for (const auto& [name, t] : strobe::safetensors::read_file(in).tensors) batch.tensors[name] = t;
  const char* input = batch.has("image") ? "image" : "tokens";
  if (!batch.has(input)) throw std::runtime_error(in + ": has no tensor 'image' or 'tokens'");
  batch.meta["batch_size"] = batch.tensors[input].size(0);
  if (batch.has("cu_seqlens")) {  // packed tokens: the host-side facts the token collate would set
    const auto cu = batch.tensors["cu_seqlens"].to(torch::kLong);
    batch.meta["batch_size"] = cu.size(0) - 1;
    batch.meta["max_seqlen"] = (cu.slice(0, 1) - cu.slice(0, 0, -1)).max().item<int64_t>();
  }
  // The model's declared training FLOPs for this batch, from the host batch (Model::training_flops).
  const auto flops = torch::tensor(model->training_flops(batch), torch::kFloat64);
  batch = batch.to(device);
  strobe::safetensors::write_file(out, {{"logits", model->forward(batch).cpu()}, {"training_flops", flops}});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if ((argc == 5 || (argc == 7 && std::string(argv[5]) == "--device")) && std::string(argv[2]) == "--logits") {
    try {
      return write_logits(argv[1], argv[3], argv[4], torch::Device(argc == 7 ? argv[6] : "cpu"));
    } catch (const strobe::config::ConfigError& e) {
      std::cerr << "strobe_model_check: config error: " << e.what() << "\n";
      return 2;
    } catch (const std::exception& e) {
      std::cerr << "strobe_model_check: " << e.what() << "\n";
      return 1;
    }
  }
  if (argc < 2 || argc > 3) {
    std::cerr << "usage: strobe_model_check MODEL_YAML [REFERENCE.pt]\n"
                 "       strobe_model_check MODEL_YAML --logits IN.safetensors OUT.safetensors [--device DEVICE]\n";
    return 2;
  }
  try {
    auto doc = strobe::config::Document::load_string(argv[1], "model");
    auto section = doc.root();
    auto model = strobe::model_registry().create(section, "");
    nlohmann::json out;
    int64_t count = 0;
    for (const auto& p : model->parameters()) count += p.numel();
    out["parameters"] = count;
    if (argc == 3) {
      auto ref = torch::jit::load(argv[2]);
      auto weights = ref.attr("weights").toGenericDict();
      std::map<std::string, torch::Tensor> given;
      for (const auto& kv : weights) given[kv.key().toStringRef()] = kv.value().toTensor();
      std::vector<std::string> missing, mismatched;
      torch::NoGradGuard guard;
      auto assign = [&](const std::string& name, torch::Tensor& t) {
        auto it = given.find(name);
        if (it == given.end()) return missing.push_back(name);
        if (it->second.sizes() != t.sizes()) {
          mismatched.push_back(name + " " + c10::str(t.sizes()) + " vs " + c10::str(it->second.sizes()));
        } else {
          t.copy_(it->second);
        }
        given.erase(it);
      };
      for (auto& kv : model->named_parameters()) assign(kv.key(), kv.value());
      for (auto& kv : model->named_buffers()) assign(kv.key(), kv.value());
      if (!missing.empty() || !mismatched.empty() || !given.empty()) {
        for (const auto& n : missing) std::cerr << "missing in reference: " << n << "\n";
        for (const auto& n : mismatched) std::cerr << "shape mismatch: " << n << "\n";
        for (const auto& kv : given) std::cerr << "unused reference weight: " << kv.first << "\n";
        return 1;
      }
      model->eval();
      strobe::Batch batch;
      auto input = ref.attr("input").toTensor();
      batch.tensors["image"] = input;
      batch.meta["batch_size"] = input.size(0);
      auto y = model->forward(batch);
      auto expected = ref.attr("expected").toTensor();
      if (y.sizes() != expected.sizes()) {
        std::cerr << "output shape " << y.sizes() << " vs expected " << expected.sizes() << "\n";
        return 1;
      }
      out["max_abs_diff"] = (y - expected).abs().max().item<double>();
      out["max_abs_expected"] = expected.abs().max().item<double>();
      out["output_shape"] = y.sizes().vec();
    }
    std::cout << out.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
