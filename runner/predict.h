// strobe predict: a model over a split's samples in dataset order, its predictions written to one
// file (docs/CONFIG.md, "strobe predict").
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "strobe/checkpoint/output_guard.h"
#include "strobe/core/loops.h"

namespace strobe {

struct PredictOptions {
  std::string output;        // -o: X.csv (classification) or X.safetensors
  bool overwrite = false;    // replace an existing output
  std::string split = "test";  // test | val
  bool logits = false;         // --logits: a language model's logits too (tokens x vocabulary, fp32)
  double logits_limit_gib = 4;  // --logits-limit-gib: refused past this many GiB of logits
};

struct PredictError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The output checked before any work: a .csv or .safetensors name (else PredictError), then the
// output guard (checkpoint::check_output_file: never one of `inputs`, another existing file only with
// `overwrite`, a folder that takes the file; else checkpoint::OutputRefused). Both exit 2.
void check_predict_output(const PredictOptions& options, const std::vector<checkpoint::CommandInput>& inputs);

// What the task makes of the outputs. classification: logits [B, C] (probabilities by softmax, or
// sigmoid under per_class_bce); language_modeling: logits over the vocabulary, from which the
// per-token loss of each document is kept (the logits themselves are too large); other: the raw
// outputs, stacked over samples.
enum class PredictKind { kClassification, kLanguageModel, kRaw };

// Collects each batch's predictions on the host as they come and writes the file at finish():
// .csv (classification only): index, file (where the dataset names its samples' files), class_name
// (where the data knows the classes' names), predicted, probability, top5 (space-separated class
// indices, most probable first); .safetensors: `outputs` (raw outputs, stacked) and `index`, or for
// a language model `token_loss` (fp32, every document's tokens in order), `offsets` (int64 [N + 1]:
// document i's tokens are token_loss[offsets[i]:offsets[i+1]]) and `index`. Written atomically.
class PredictWriter : public PredictSink {
 public:
  PredictWriter(PredictOptions options, PredictKind kind, bool sigmoid, std::vector<std::string> class_names);
  void consume(const Batch& batch, const std::vector<int64_t>& indices, const torch::Tensor& outputs,
               const data::Dataset& dataset) override;
  int64_t samples() const { return static_cast<int64_t>(index_.size()); }
  // Writes the file; returns the number of samples in it.
  int64_t finish();

 private:
  void write();  // the file, atomically
  PredictOptions options_;
  PredictKind kind_;
  bool sigmoid_, csv_;
  std::vector<std::string> class_names_;
  std::vector<int64_t> index_;
  std::vector<torch::Tensor> outputs_;        // raw (kRaw), per-token losses (kLanguageModel)
  std::vector<int64_t> lengths_;              // kLanguageModel: tokens per document
  std::vector<torch::Tensor> logits_;         // kLanguageModel with --logits: each document's [tokens, vocab]
  uint64_t logits_bytes_ = 0;
  std::string rows_;                          // the CSV's rows so far
};

}  // namespace strobe
