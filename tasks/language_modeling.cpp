// language_modeling: next-token cross entropy. The collate already shifted the sequences:
// batch["targets"] holds token t+1 at position t, -100 at padding (strobe/data/collate_tokens.h), so the
// same code serves padded [B, S] and packed [T] batches and the two give the same loss on the same
// sequences (mean over real tokens). Logs the loss as a device tensor (no host reads).
// fused_loss (auto | true | false): strobe::cross_entropy over the logits in their own dtype (fp32
// loss; one kernel each way) instead of ATen's on an fp32 copy; auto = on CUDA with the CUDA kernels.
// fused_linear_loss (auto | true | false): the head and the loss as ops::linear_cross_entropy from the
// model's head input (Model::forward_head_input: llama, decoder_lm), chunk by chunk, never building
// the [tokens, vocabulary] logits; the same loss, for training, validation and `strobe replay`.
// auto = on CUDA with the CUDA kernels for a vocabulary of at least kFusedLinearMinVocab tokens.
#include <functional>

#include <torch/torch.h>

#include "strobe/core/activation_checkpoint.h"
#include "strobe/core/forensics.h"
#include "strobe/core/module.h"
#include "strobe/ops/ops.h"
#include "tasks/fused_loss.h"

namespace strobe {
namespace {

constexpr int64_t kIgnoreIndex = -100;
// fused_linear_loss: auto's threshold. At Llama-3.2-1B's 128,256 tokens the fused head is as fast as
// the logits path and saves 6 GiB (docs/PERFORMANCE.md); below this the logits are small and the
// logits path's one-kernel cross-entropy is the better fit for the short rows.
constexpr int64_t kFusedLinearMinVocab = 32768;

class LanguageModelingTask : public Module {
 public:
  LanguageModelingTask(std::shared_ptr<Model> model, std::string fused_loss, std::string fused_linear)
      : model_(std::move(model)), fused_loss_(std::move(fused_loss)), fused_linear_(std::move(fused_linear)) {}

  torch::nn::Module& net() override { return *model_; }
  std::vector<std::string> batch_keys() const override { return {"targets"}; }

  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) const {
    ModuleScope scope("task.loss");
    if (use_fused_loss(logits))
      return ops::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}).to(torch::kLong),
                                kIgnoreIndex);
    return torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32), targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex));
  }

  // The fused head's loss (fused_linear_loss): from the head input, never building the logits.
  torch::Tensor head_loss(const Model::HeadInput& head, const torch::Tensor& targets) const {
    ModuleScope scope("task.loss");
    const auto& w = head.weight;
    const auto of = [&](const torch::Tensor& h) {
      return ops::linear_cross_entropy(h.reshape({-1, h.size(-1)}).to(w.scalar_type()), w, head.bias,
                                       targets.reshape({-1}).to(torch::kLong), kIgnoreIndex);
    };
    return head.module ? run_in_unit(*head.module, head.hidden, of) : of(head.hidden);  // gathered under fsdp
  }

  // The batch's mean next-token loss: through the logits, or (fused_linear_loss) from the head input.
  torch::Tensor batch_loss(const Batch& batch) {
    if (!use_fused_linear(batch)) return loss(model_->forward(batch), batch.at("targets"));
    return head_loss(model_->forward_head_input(batch), batch.at("targets"));
  }

  torch::Tensor training_step(const Batch& batch, int64_t) override {
    auto l = batch_loss(batch);
    log("train/loss", l.detach(), LogOptions{true, std::nullopt, true});
    return l;
  }

  void on_data_info(const DataInfo& info) override { sources_ = info.source_names; }

  void evaluate(const Batch& batch, const std::string& prefix) {
    if (sources_.empty() || !batch.tensors.count("source")) {
      auto l = batch_loss(batch).detach();
      log(prefix + "/loss", l, LogOptions{std::nullopt, std::nullopt, true});
      return;
    }
    // A mix (data.sources): one forward, then the loss over every token and over each source's
    // tokens alone (the other sources' targets ignored), each source's weighted by its sequences.
    const auto& targets = batch.at("targets");
    std::function<torch::Tensor(const torch::Tensor&)> loss_of;
    Model::HeadInput head;
    torch::Tensor logits;
    if (use_fused_linear(batch)) {
      head = model_->forward_head_input(batch);
      loss_of = [&](const torch::Tensor& t) { return head_loss(head, t); };
    } else {
      logits = model_->forward(batch);
      loss_of = [&](const torch::Tensor& t) { return loss(logits, t); };
    }
    log(prefix + "/loss", loss_of(targets).detach(), LogOptions{std::nullopt, std::nullopt, true});
    const auto& source = batch.at("source");
    // Each token's source: [B, S] for a padded batch, [T] for a packed one (the sequences' lengths).
    const auto per_token = targets.dim() == 2 ? source.view({-1, 1}).expand_as(targets)
                                              : torch::repeat_interleave(source, batch.at("lengths"), 0, targets.size(0));
    for (size_t s = 0; s < sources_.size(); ++s) {
      const auto n = batch.meta.find(kMetaSourcePrefix + std::to_string(s));
      if (n == batch.meta.end() || n->second == 0) continue;  // none of its sequences in this batch
      const auto mine = targets.masked_fill(per_token.ne(static_cast<int64_t>(s)), kIgnoreIndex);
      log(prefix + "/" + sources_[s] + "/loss", loss_of(mine).detach(), LogOptions{std::nullopt, std::nullopt, false}, n->second);
    }
  }

  void validation_step(const Batch& batch, int64_t) override { evaluate(batch, "val"); }
  void test_step(const Batch& batch, int64_t) override { evaluate(batch, "test"); }

 private:
  bool use_fused_loss(const torch::Tensor& logits) const {
    return use_fused_cross_entropy(fused_loss_, logits, "language_modeling");
  }
  bool use_fused_linear(const Batch& batch) const {
    if (fused_linear_ != "auto") return fused_linear_ == "true";
    return model_->head_input_vocab() >= kFusedLinearMinVocab && batch.at("tokens").is_cuda() && ops::built_with_cuda();
  }

  std::shared_ptr<Model> model_;
  std::string fused_loss_;
  std::string fused_linear_;
  std::vector<std::string> sources_;  // a mix's source names (data.sources), by the batches' source ids
};

std::shared_ptr<Module> make_language_modeling(config::Section& cfg, std::shared_ptr<Model> model) {
  cfg.get_choice("loss", "cross_entropy", {"cross_entropy"});
  std::string fused = cfg.get_choice("fused_loss", "auto", {"auto", "true", "false"});
  std::string fused_linear = cfg.get_choice("fused_linear_loss", "auto", {"auto", "true", "false"});
  if (fused_linear == "true" && model->head_input_vocab() == 0)
    cfg.fail("fused_linear_loss", "needs a model that hands its head's input to the loss (llama, decoder_lm); " +
                                      model->name() + " has none");
  cfg.finish();
  return std::make_shared<LanguageModelingTask>(std::move(model), fused, fused_linear);
}

STROBE_REGISTER(task_registry(), "language_modeling", make_language_modeling);

}  // namespace
}  // namespace strobe
