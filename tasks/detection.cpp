// detection: boxes [B, N, 4] from the model, padded targets in batch["boxes"] [B, N, 4] (a row is a
// box when its y2 > 0). The loss is 1 - mean GIoU over the valid rows (0 for a batch without boxes),
// computed by the strobe::giou_loss op on CUDA when it is built (`giou: auto | op`), else by the ATen
// reference (tasks/giou_reference.h). Validation logs loss and mean GIoU (device tensors).
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/forensics.h"
#include "strobe/core/module.h"
#include "tasks/giou_reference.h"
#ifdef STROBE_HAS_OPS
#include "strobe/ops/ops.h"
#endif

namespace strobe {
namespace {

class DetectionTask : public Module {
 public:
  DetectionTask(std::shared_ptr<Model> model, std::string impl) : model_(std::move(model)), impl_(std::move(impl)) {}

  torch::nn::Module& net() override { return *model_; }
  std::vector<std::string> batch_keys() const override { return {"boxes"}; }

  // Mean GIoU of valid rows (the op's and the seed's loss_with_padding value).
  torch::Tensor mean_giou(const torch::Tensor& pred, const torch::Tensor& target) const {
    ModuleScope scope("task.loss");
#ifdef STROBE_HAS_OPS
    if (impl_ == "op" || (impl_ == "auto" && pred.is_cuda())) return ops::giou_loss(pred, target, "mean");
#endif
    return tasks::giou_loss_padded_reference(pred, target, "mean");
  }

  torch::Tensor training_step(const Batch& batch, int64_t) override {
    const auto& target = batch.at("boxes");
    auto loss = tasks::giou_objective_from_mean(mean_giou(model_->forward(batch), target), target);
    log("train/loss", loss.detach(), LogOptions{true, std::nullopt, true});
    return loss;
  }

  void evaluate(const Batch& batch, const std::string& prefix) {
    const auto& target = batch.at("boxes");
    auto giou = mean_giou(model_->forward(batch), target).detach();
    log(prefix + "/loss", tasks::giou_objective_from_mean(giou, target));
    log(prefix + "/giou", giou, LogOptions{std::nullopt, std::nullopt, true});
  }

  void validation_step(const Batch& batch, int64_t) override { evaluate(batch, "val"); }
  void test_step(const Batch& batch, int64_t) override { evaluate(batch, "test"); }

 private:
  std::shared_ptr<Model> model_;
  std::string impl_;
};

std::shared_ptr<Module> make_detection(config::Section& cfg, std::shared_ptr<Model> model) {
  cfg.get_choice("loss", "giou", {"giou"});
  std::string impl = cfg.get_choice("giou", "auto", {"auto", "op", "reference"});
#ifndef STROBE_HAS_OPS
  if (impl == "op") cfg.fail("giou", "the strobe::giou_loss op is not built in this binary (use auto or reference)");
#endif
  cfg.finish();
  return std::make_shared<DetectionTask>(std::move(model), impl);
}

STROBE_REGISTER(task_registry(), "detection", make_detection);

}  // namespace
}  // namespace strobe
