// regression: the model's outputs against batch["target"] (docs/CONFIG.md, "task").
// loss: mse (default), l1 or huber (delta, default 1.0), the mean over every value, in fp32.
// The target is [B] (one value per sample) or [B, W]; the outputs must hold exactly W values per
// sample ([B, W], or [B] when W is 1): ATen's losses would broadcast [B, 1] against [B] into a
// [B, B] difference without a word, so any other shape is an error naming both (the data module's
// target width is checked against the model's num_classes before training, runner/experiment_builder).
// Validation and test log <stage>/loss (the task's loss), <stage>/mse and <stage>/mae (means over
// every value, weighted by batch size).
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/forensics.h"
#include "strobe/core/model.h"
#include "strobe/core/module.h"

namespace strobe {
namespace {

class RegressionTask : public Module {
 public:
  RegressionTask(std::shared_ptr<Model> model, std::string loss, double delta)
      : model_(std::move(model)), loss_(std::move(loss)), delta_(delta) {}

  torch::nn::Module& net() override { return *model_; }
  std::vector<std::string> batch_keys() const override { return {"target"}; }

  // The outputs and the target as [B, W] fp32, or an error naming both shapes.
  std::pair<torch::Tensor, torch::Tensor> aligned(const torch::Tensor& out, const torch::Tensor& target) const {
    const torch::Tensor y = target.dim() == 1 ? target.unsqueeze(1) : target.flatten(1);
    const torch::Tensor p = out.dim() == 1 ? out.unsqueeze(1) : out;
    if (p.dim() != 2 || p.sizes() != y.sizes())
      throw std::runtime_error(fmt::format("regression: the model's outputs {} do not match the target {} (one output per "
                                           "target value is needed: set the model's output width, e.g. num_classes: {})",
                                           c10::str(out.sizes()), c10::str(target.sizes()), y.size(1)));
    return {p.to(torch::kFloat32), y.to(torch::kFloat32)};
  }

  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& target) const {
    ModuleScope scope("task.loss");
    const auto [p, y] = aligned(out, target);
    namespace F = torch::nn::functional;
    if (loss_ == "l1") return F::l1_loss(p, y);
    if (loss_ == "huber") return F::huber_loss(p, y, F::HuberLossFuncOptions().delta(delta_));
    return F::mse_loss(p, y);
  }

  torch::Tensor training_step(const Batch& batch, int64_t) override {
    auto l = loss(model_->forward(batch), batch.at("target"));
    log("train/loss", l.detach(), LogOptions{true, std::nullopt, true});
    return l;
  }

  void evaluate(const Batch& batch, const std::string& prefix) {
    const auto out = model_->forward(batch);
    const auto [p, y] = aligned(out, batch.at("target"));
    log(prefix + "/loss", loss(out, batch.at("target")).detach());
    log(prefix + "/mse", (p - y).square().mean().detach());
    log(prefix + "/mae", (p - y).abs().mean().detach());
  }
  void validation_step(const Batch& batch, int64_t) override { evaluate(batch, "val"); }
  void test_step(const Batch& batch, int64_t) override { evaluate(batch, "test"); }

 private:
  std::shared_ptr<Model> model_;
  std::string loss_;
  double delta_;
};

std::shared_ptr<Module> make_regression(config::Section& cfg, std::shared_ptr<Model> model) {
  const std::string loss = cfg.get_choice("loss", "mse", {"mse", "l1", "huber"});
  double delta = 1.0;
  if (loss == "huber") delta = cfg.get_double("delta", 1.0, 1e-12);
  else if (!cfg.is_null("delta")) cfg.fail("delta", "applies to loss: huber");
  else cfg.accept("delta");
  cfg.finish();
  return std::make_shared<RegressionTask>(std::move(model), loss, delta);
}

STROBE_REGISTER(task_registry(), "regression", make_regression);

}  // namespace
}  // namespace strobe
