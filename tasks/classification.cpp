// classification: logits from the model's forward, labels in batch["label"].
// loss: cross_entropy, or per_class_bce — the seed's loss: for each class, BCE-with-logits summed
// over the batch and divided by the number of samples of that class, averaged over classes. It is
// NaN (0/0) whenever a class is absent from a batch, by design: the NaN-capture workload.
// Validation and test log <stage>/loss (per-batch mean, weighted by batch size) and the configured
// metrics (default: acc, f1 — macro over classes, TorchMetrics' convention) from one device-side
// confusion matrix that is updated every batch and read once at the end of the epoch.
// fused_loss (auto | true | false): cross_entropy through strobe::cross_entropy (one kernel each
// way over the logits in their own dtype, fp32 loss) instead of ATen's on fp32 logits; auto = on
// CUDA when the ops have their CUDA kernels and label_smoothing is 0.
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/forensics.h"
#include "strobe/core/module.h"
#include "strobe/metrics/collection.h"
#include "strobe/metrics/registry.h"
#include "strobe/ops/ops.h"
#include "tasks/fused_loss.h"

namespace strobe {
namespace {

class ClassificationTask : public Module {
 public:
  ClassificationTask(std::shared_ptr<Model> model, std::string loss, double label_smoothing,
                     std::vector<std::string> metrics, metrics::Average average, std::string fused_loss)
      : model_(std::move(model)), loss_(std::move(loss)), label_smoothing_(label_smoothing),
        metric_names_(std::move(metrics)), average_(average), fused_loss_(std::move(fused_loss)) {}

  torch::nn::Module& net() override { return *model_; }
  std::vector<std::string> batch_keys() const override { return {"label"}; }

  // In fp32 whatever the logits' dtype (what autocast does for these ops; bf16-master logits are bf16).
  torch::Tensor loss(const torch::Tensor& logits_in, const torch::Tensor& y) const {
    ModuleScope scope("task.loss");
    if (use_fused_loss(logits_in)) return ops::cross_entropy(logits_in, y.to(torch::kLong));
    const torch::Tensor logits = logits_in.to(torch::kFloat32);
    if (loss_ == "cross_entropy") {
      return torch::nn::functional::cross_entropy(
          logits, y, torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(label_smoothing_));
    }
    const int64_t c = logits.size(-1);
    auto onehot = torch::one_hot(y, c).to(logits.scalar_type());
    auto per_class_sum = torch::binary_cross_entropy_with_logits(logits, onehot, {}, {}, at::Reduction::None).sum(0);
    auto count = onehot.sum(0);
    return (per_class_sum / count).mean();
  }

  torch::Tensor training_step(const Batch& batch, int64_t) override {
    auto logits = model_->forward(batch);
    auto l = loss(logits, batch.at("label"));
    log("train/loss", l.detach(), LogOptions{true, std::nullopt, true});
    return l;
  }

  void evaluate(const Batch& batch, const std::string& prefix) {
    auto logits = model_->forward(batch);
    const auto& y = batch.at("label");
    log(prefix + "/loss", loss(logits, y).detach());
    if (!collection_) {
      // Built on first use: the class count and device come from the logits (host-known shape).
      metrics::MetricOptions o;
      o.num_classes = logits.size(-1);
      o.average = average_;
      o.device = logits.device();
      collection_ = std::make_unique<metrics::MetricCollection>();
      for (const auto& m : metric_names_) collection_->add(short_name(m), metrics::make_metric(m, o));
    }
    collection_->update(logits.detach(), y);
  }

  void log_metrics(const std::string& prefix) {
    if (!collection_) return;
    sync_metrics(*collection_);  // data parallel: the states of every rank (reset below drops them)
    for (auto& [name, value] : collection_->compute()) log(prefix + "/" + name, value, LogOptions{false, true, true});
    collection_->reset();
  }

  void validation_step(const Batch& batch, int64_t) override { evaluate(batch, "val"); }
  void test_step(const Batch& batch, int64_t) override { evaluate(batch, "test"); }
  void on_validation_epoch_start() override {
    if (collection_) collection_->reset();
  }
  void on_validation_epoch_end() override { log_metrics(stage() == Stage::Test ? "test" : "val"); }
  void on_test_epoch_end() override { log_metrics("test"); }

  static std::string short_name(const std::string& m) { return m == "accuracy" ? "acc" : m; }

 private:
  std::shared_ptr<Model> model_;
  // Only for cross_entropy without label smoothing (make_classification rejects `true` otherwise).
  bool use_fused_loss(const torch::Tensor& logits) const {
    if (loss_ != "cross_entropy" || label_smoothing_ != 0.0 || logits.dim() != 2) return false;
    return use_fused_cross_entropy(fused_loss_, logits, "classification");
  }

  std::string loss_;
  double label_smoothing_;
  std::vector<std::string> metric_names_;
  metrics::Average average_;
  std::string fused_loss_;
  std::unique_ptr<metrics::MetricCollection> collection_;
};

std::shared_ptr<Module> make_classification(config::Section& cfg, std::shared_ptr<Model> model) {
  std::string loss = cfg.get_choice("loss", "cross_entropy", {"cross_entropy", "per_class_bce"});
  double ls = cfg.get_double("label_smoothing", 0.0, 0.0, 1.0);
  std::vector<std::string> names;
  cfg.accept("metrics");
  auto node = cfg.node()["metrics"];
  if (!node.IsDefined() || node.IsNull()) {
    names = {"accuracy", "f1"};
    YAML::Node seq(YAML::NodeType::Sequence);
    for (auto& n : names) seq.push_back(n);
    cfg.node()["metrics"] = seq;
  } else {
    if (!node.IsSequence()) cfg.fail("metrics", "expected a list, e.g. [accuracy, precision, recall, f1]");
    for (const auto& n : node) {
      std::string m = n.IsScalar() ? n.Scalar() : "";
      if (m != "accuracy" && m != "precision" && m != "recall" && m != "f1")
        cfg.fail("metrics", fmt::format("unknown classification metric '{}' (known: accuracy, precision, recall, f1)", m));
      names.push_back(m);
    }
  }
  std::string avg = cfg.get_choice("average", "macro", {"micro", "macro", "weighted"});
  std::string fused = cfg.get_choice("fused_loss", "auto", {"auto", "true", "false"});
  if (fused == "true" && (loss != "cross_entropy" || ls != 0.0))
    cfg.fail("fused_loss", "true needs loss: cross_entropy with label_smoothing: 0 (the fused op has neither)");
  cfg.finish();
  return std::make_shared<ClassificationTask>(std::move(model), loss, ls, names, metrics::parse_average(avg), fused);
}

STROBE_REGISTER(task_registry(), "classification", make_classification);

}  // namespace
}  // namespace strobe
