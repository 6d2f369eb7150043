// language_modeling: next-token cross entropy. The collate already shifted the sequences:
// batch["targets"] holds token t+1 at position t, -100 at padding (framework/data/collate_tokens.h), so the
// same code serves padded [B, S] and packed [T] batches and the two give the same loss on the same
// sequences (mean over real tokens). Logs the loss as a device tensor (no host reads).
// fused_loss (auto | true | false): strobe::cross_entropy over the logits in their own dtype (fp32
// loss; one kernel each way) instead of ATen's on an fp32 copy; auto = on CUDA with the CUDA kernels.
#include <torch/torch.h>

#include "framework/core/forensics.h"
#include "framework/core/module.h"
#include "framework/ops/ops.h"
#include "tasks/fused_loss.h"

namespace strobe {
namespace {

constexpr int64_t kIgnoreIndex = -100;

class LanguageModelingTask : public Module {
 public:
  LanguageModelingTask(std::shared_ptr<Model> model, std::string fused_loss)
      : model_(std::move(model)), fused_loss_(std::move(fused_loss)) {}

  torch::nn::Module& net() override { return *model_; }

  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) const {
    ModuleScope scope("task.loss");
    if (use_fused_loss(logits))
      return ops::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}).to(torch::kLong),
                                kIgnoreIndex);
    return torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32), targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex));
  }

  torch::Tensor training_step(const Batch& batch, int64_t) override {
    auto l = loss(model_->forward(batch), batch.at("targets"));
    log("train/loss", l.detach(), LogOptions{true, std::nullopt, true});
    return l;
  }

  void evaluate(const Batch& batch, const std::string& prefix) {
    auto l = loss(model_->forward(batch), batch.at("targets")).detach();
    log(prefix + "/loss", l, LogOptions{std::nullopt, std::nullopt, true});
  }

  void validation_step(const Batch& batch, int64_t) override { evaluate(batch, "val"); }
  void test_step(const Batch& batch, int64_t) override { evaluate(batch, "test"); }

 private:
  bool use_fused_loss(const torch::Tensor& logits) const {
    return use_fused_cross_entropy(fused_loss_, logits, "language_modeling");
  }

  std::shared_ptr<Model> model_;
  std::string fused_loss_;
};

std::shared_ptr<Module> make_language_modeling(config::Section& cfg, std::shared_ptr<Model> model) {
  cfg.get_choice("loss", "cross_entropy", {"cross_entropy"});
  std::string fused = cfg.get_choice("fused_loss", "auto", {"auto", "true", "false"});
  cfg.finish();
  return std::make_shared<LanguageModelingTask>(std::move(model), fused);
}

STROBE_REGISTER(task_registry(), "language_modeling", make_language_modeling);

}  // namespace
}  // namespace strobe
