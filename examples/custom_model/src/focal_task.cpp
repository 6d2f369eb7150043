// example_focal: a classification task with its own loss and its own metric.
//
// Loss: focal loss (Lin et al., 2017), mean over the batch of -(1 - p_y)^gamma * log p_y, where p_y
// is the softmax probability of the true class: gamma = 0 is cross-entropy; a larger gamma weighs
// the points the model still gets wrong (here the arms' tangled centre) above the easy ones.
// Metric: example_worst_class_accuracy, the lowest per-class accuracy — a model that gives up on one
// arm scores low however good the others are. Its state is two per-class counts kept on the device
// (no host read per batch) and summed across ranks under data parallel (sync_metrics).
//
// Logged: train/loss (every step), val/loss, val/acc (the built-in accuracy metric, by name),
// val/worst_class_acc (once per epoch); test/... likewise.
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/forensics.h"
#include "strobe/core/module.h"
#include "strobe/metrics/collection.h"
#include "strobe/metrics/registry.h"

namespace strobe_example {

class WorstClassAccuracy : public strobe::metrics::Metric {
 public:
  explicit WorstClassAccuracy(const strobe::metrics::MetricOptions& o) : Metric("example_worst_class_accuracy", o.device) {
    if (o.num_classes < 2) throw std::invalid_argument("example_worst_class_accuracy needs num_classes >= 2");
    const auto opts = torch::TensorOptions(o.device).dtype(torch::kFloat64);
    correct_ = add_state("correct", torch::zeros({o.num_classes}, opts), Reduction::kSum);
    total_ = add_state("total", torch::zeros({o.num_classes}, opts), Reduction::kSum);
  }
  // logits [B, C], labels [B]
  void update(const torch::Tensor& logits, const torch::Tensor& labels) override {
    const auto y = labels.to(torch::kLong);
    const auto hit = (logits.argmax(1) == y).to(torch::kFloat64);
    state(correct_).index_add_(0, y, hit);
    state(total_).index_add_(0, y, torch::ones_like(hit));
  }
  // Classes absent from the data are left out (their accuracy is undefined, not 0).
  torch::Tensor compute() const override {
    const auto& total = state(total_);
    const auto acc = state(correct_) / total.clamp_min(1.0);
    return torch::where(total > 0, acc, torch::full_like(acc, 1.0)).min();
  }

 private:
  size_t correct_ = 0, total_ = 0;
};
STROBE_REGISTER(strobe::metrics::metric_registry(), "example_worst_class_accuracy",
                strobe::metrics::metric_factory<WorstClassAccuracy>());

class FocalTask : public strobe::Module {
 public:
  FocalTask(std::shared_ptr<strobe::Model> model, double gamma) : model_(std::move(model)), gamma_(gamma) {}

  torch::nn::Module& net() override { return *model_; }
  std::vector<std::string> batch_keys() const override { return {"label"}; }

  // In fp32 whatever the logits' dtype. ModuleScope names the region for `strobe replay`.
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& labels) const {
    strobe::ModuleScope scope("task.loss");
    const auto logp = torch::log_softmax(logits.to(torch::kFloat32), 1).gather(1, labels.to(torch::kLong).unsqueeze(1)).squeeze(1);
    const auto weight = gamma_ == 0.0 ? torch::ones_like(logp) : torch::pow(1.0 - logp.exp(), gamma_);
    return -(weight * logp).mean();
  }

  torch::Tensor training_step(const strobe::Batch& batch, int64_t) override {
    auto l = loss(model_->forward(batch), batch.at("label"));
    log("train/loss", l.detach(), strobe::LogOptions{true, std::nullopt, true});
    return l;
  }

  void validation_step(const strobe::Batch& batch, int64_t) override { evaluate(batch, "val"); }
  void test_step(const strobe::Batch& batch, int64_t) override { evaluate(batch, "test"); }
  void on_validation_epoch_start() override {
    if (metrics_) metrics_->reset();
  }
  void on_validation_epoch_end() override { log_metrics(stage() == strobe::Stage::Test ? "test" : "val"); }
  void on_test_epoch_end() override { log_metrics("test"); }

 private:
  void evaluate(const strobe::Batch& batch, const std::string& prefix) {
    const auto logits = model_->forward(batch);
    const auto& y = batch.at("label");
    log(prefix + "/loss", loss(logits, y).detach());
    if (!metrics_) {  // on first use: the class count and the device come from the logits
      strobe::metrics::MetricOptions o;
      o.num_classes = logits.size(1);
      o.device = logits.device();
      metrics_ = std::make_unique<strobe::metrics::MetricCollection>();
      metrics_->add("acc", strobe::metrics::make_metric("accuracy", o));
      metrics_->add("worst_class_acc", strobe::metrics::make_metric("example_worst_class_accuracy", o));
    }
    metrics_->update(logits.detach(), y);
  }
  void log_metrics(const std::string& prefix) {
    if (!metrics_) return;
    sync_metrics(*metrics_);  // data parallel: every rank's counts
    for (auto& [name, value] : metrics_->compute()) log(prefix + "/" + name, value, strobe::LogOptions{false, true, true});
    metrics_->reset();
  }

  std::shared_ptr<strobe::Model> model_;
  double gamma_;
  std::unique_ptr<strobe::metrics::MetricCollection> metrics_;
};

// task: {name: example_focal, gamma: 2.0}
std::shared_ptr<strobe::Module> make_focal_task(strobe::config::Section& cfg, std::shared_ptr<strobe::Model> model) {
  const double gamma = cfg.get_double("gamma", 2.0, 0.0, 10.0);
  cfg.finish();
  return std::make_shared<FocalTask>(std::move(model), gamma);
}
STROBE_REGISTER(strobe::task_registry(), "example_focal", make_focal_task);

}  // namespace strobe_example
