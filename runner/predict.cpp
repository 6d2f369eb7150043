#include "runner/predict.h"

#include <cmath>
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/safetensors.h"
#include "strobe/data/dataset.h"

namespace strobe {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A CSV field: quoted when it holds a comma, a quote or a line break (RFC 4180).
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

}  // namespace

void check_predict_output(const PredictOptions& o, const std::vector<checkpoint::CommandInput>& inputs) {
  const bool csv = ends_with(o.output, ".csv"), st = ends_with(o.output, ".safetensors");
  if (!csv && !st) throw PredictError(fmt::format("-o {}: expected a .csv or a .safetensors file name", o.output));
  if (o.split != "test" && o.split != "val") throw PredictError(fmt::format("--split {}: expected test or val", o.split));
  if (o.logits && csv) throw PredictError(fmt::format("--logits: a CSV holds no logits; write -o X.safetensors"));
  if (!(o.logits_limit_gib > 0) || !std::isfinite(o.logits_limit_gib))
    throw PredictError(fmt::format("--logits-limit-gib {}: expected a positive number of GiB", o.logits_limit_gib));
  checkpoint::OutputFile out;
  out.option = "-o";
  out.path = o.output;
  out.overwrite = o.overwrite;
  out.inputs = inputs;
  checkpoint::check_output_file(out);
}

PredictWriter::PredictWriter(PredictOptions options, PredictKind kind, bool sigmoid, std::vector<std::string> class_names)
    : options_(std::move(options)), kind_(kind), sigmoid_(sigmoid), csv_(ends_with(options_.output, ".csv")),
      class_names_(std::move(class_names)) {
  if (options_.logits && kind_ != PredictKind::kLanguageModel)
    throw PredictError(fmt::format("--logits: for language models, whose file otherwise holds per-token losses; this "
                                   "task's -o {} holds its raw outputs (`outputs`) already",
                                   options_.output));
  if (csv_ && kind_ != PredictKind::kClassification)
    throw PredictError(fmt::format("-o {}: a CSV of predicted classes is written for classification; this task's "
                                   "predictions go to a .safetensors file",
                                   options_.output));
}

void PredictWriter::consume(const Batch& batch, const std::vector<int64_t>& indices, const torch::Tensor& outputs,
                            const data::Dataset& dataset) {
  torch::NoGradGuard ng;
  const int64_t n = batch.batch_size();
  if (static_cast<int64_t>(indices.size()) != n)
    throw std::logic_error(fmt::format("predict: a batch of {} samples carries {} dataset indices", n, indices.size()));
  index_.insert(index_.end(), indices.begin(), indices.end());
  if (kind_ == PredictKind::kLanguageModel) {
    // Per-token loss of each document, on the device in fp32 chunks, then to the host.
    const auto& targets = batch.at("targets");
    const auto lengths = batch.at("lengths").to(torch::kCPU);
    const int64_t vocab = outputs.size(-1);
    const bool packed = batch.has("cu_seqlens");
    std::vector<torch::Tensor> rows;
    auto token_loss = [&](const torch::Tensor& logits, const torch::Tensor& t) {
      std::vector<torch::Tensor> parts;
      for (int64_t at = 0; at < logits.size(0); at += 4096) {
        const int64_t len = std::min<int64_t>(4096, logits.size(0) - at);
        parts.push_back(torch::nn::functional::cross_entropy(
            logits.narrow(0, at, len).to(torch::kFloat32), t.narrow(0, at, len),
            torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone)));
      }
      return parts.empty() ? torch::empty({0}, logits.options().dtype(torch::kFloat32)) : torch::cat(parts);
    };
    // --logits: the rows the losses came from, fp32 on the host, within the limit.
    auto keep_logits = [&](const torch::Tensor& rows) {
      if (!options_.logits) return;
      logits_bytes_ += static_cast<uint64_t>(rows.numel()) * sizeof(float);
      const double limit = options_.logits_limit_gib * 1024.0 * 1024.0 * 1024.0;
      if (static_cast<double>(logits_bytes_) > limit)
        throw PredictError(fmt::format(
            "--logits: the logits of the first {} documents already take {:.2f} GiB (fp32, {} tokens x {} vocabulary), "
            "over --logits-limit-gib {:g}; nothing written. Raise the limit, or take them from transformers: strobe export "
            "CKPT --names hf -o DIR, then AutoModelForCausalLM.from_pretrained(DIR) (docs/CONFIG.md, \"strobe predict\")",
            index_.size(), static_cast<double>(logits_bytes_) / (1024.0 * 1024.0 * 1024.0),
            logits_bytes_ / sizeof(float) / static_cast<uint64_t>(vocab), vocab, options_.logits_limit_gib));
      logits_.push_back(rows.to(torch::kCPU, torch::kFloat32));
    };
    if (packed) {
      outputs_.push_back(token_loss(outputs.reshape({-1, vocab}), targets.reshape({-1})).to(torch::kCPU));
      keep_logits(outputs.reshape({-1, vocab}));
    } else {
      for (int64_t r = 0; r < n; ++r) {
        const int64_t len = lengths[r].item<int64_t>();
        outputs_.push_back(token_loss(outputs[r].narrow(0, 0, len), targets[r].narrow(0, 0, len)).to(torch::kCPU));
        keep_logits(outputs[r].narrow(0, 0, len));
      }
    }
    for (int64_t r = 0; r < n; ++r) lengths_.push_back(lengths[r].item<int64_t>());
    return;
  }
  if (!csv_) {
    outputs_.push_back(outputs.detach().to(torch::kCPU));
    return;
  }
  TORCH_CHECK(outputs.dim() == 2 && outputs.size(0) == n, "predict: classification outputs must be [batch, classes], got ",
              outputs.sizes());
  const auto probs = (sigmoid_ ? torch::sigmoid(outputs.to(torch::kFloat32)) : torch::softmax(outputs.to(torch::kFloat32), 1)).to(torch::kCPU);
  const int64_t k = std::min<int64_t>(5, probs.size(1));
  const auto [top_p, top_i] = probs.topk(k, 1);
  const auto p = top_p.accessor<float, 2>();
  const auto ix = top_i.accessor<int64_t, 2>();
  const bool files = !dataset.describe(indices.front()).empty();
  for (int64_t r = 0; r < n; ++r) {
    std::string row = std::to_string(indices[r]);
    if (files) row += "," + csv_field(dataset.describe(indices[r]));
    const int64_t pred = ix[r][0];
    if (!class_names_.empty())
      row += "," + csv_field(pred < static_cast<int64_t>(class_names_.size()) ? class_names_[pred] : std::string());
    row += fmt::format(",{},{:.9g},", pred, p[r][0]);
    for (int64_t j = 0; j < k; ++j) row += (j ? " " : "") + std::to_string(ix[r][j]);
    rows_ += row + "\n";
  }
  if (index_.size() == indices.size()) {
    // The header, once the first batch says whether the dataset names files.
    std::string header = "index";
    if (files) header += ",file";
    if (!class_names_.empty()) header += ",class_name";
    rows_ = header + ",predicted,probability,top5\n" + rows_;
  }
}

int64_t PredictWriter::finish() {
  checkpoint::write_output("-o", options_.output, [&] { write(); });
  return static_cast<int64_t>(index_.size());
}

void PredictWriter::write() {
  if (csv_) {
    if (rows_.empty()) rows_ = "index,predicted,probability,top5\n";
    checkpoint::write_file_atomic(options_.output, rows_);
    return;
  }
  safetensors::NamedTensors tensors;
  const auto index = torch::tensor(index_, torch::kInt64);
  if (kind_ == PredictKind::kLanguageModel) {
    std::vector<int64_t> offsets(1, 0);
    for (int64_t len : lengths_) offsets.push_back(offsets.back() + len);
    tensors.emplace_back("token_loss", outputs_.empty() ? torch::empty({0}) : torch::cat(outputs_));
    tensors.emplace_back("offsets", torch::tensor(offsets, torch::kInt64));
    if (options_.logits)
      tensors.emplace_back("logits", logits_.empty() ? torch::empty({0}) : torch::cat(logits_).contiguous());
  } else {
    tensors.emplace_back("outputs", outputs_.empty() ? torch::empty({0}) : torch::cat(outputs_));
  }
  tensors.emplace_back("index", index);
  safetensors::write_file(options_.output, tensors, {{"format", "pt"}, {"strobe.split", options_.split}});
}

}  // namespace strobe
