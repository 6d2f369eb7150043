#include "strobe/data/collate_tokens.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>
#include <torch/torch.h>

namespace strobe::data {
namespace {

const torch::Tensor& field(const Sample& s, const char* key) {
  auto it = s.find(key);
  if (it == s.end()) throw std::runtime_error(fmt::format("token collate: sample has no '{}'", key));
  return it->second;
}

std::vector<int64_t> lengths_of(const std::vector<Sample>& samples) {
  std::vector<int64_t> lengths;
  lengths.reserve(samples.size());
  for (const auto& s : samples) {
    const auto& t = field(s, "tokens");
    if (t.dim() != 1 || field(s, "targets").sizes() != t.sizes())
      throw std::runtime_error(fmt::format("token collate: tokens {} and targets {} must be the same 1-d shape",
                                           c10::str(t.sizes()), c10::str(field(s, "targets").sizes())));
    lengths.push_back(t.size(0));
  }
  return lengths;
}

// A mix's samples carry their source (strobe/data/mix.h): the batch carries them too, [B] int64.
void add_sources(Batch& batch, const std::vector<Sample>& samples) {
  if (samples.empty() || !samples[0].count("source")) return;
  std::vector<int64_t> sources;
  for (const auto& s : samples) {
    sources.push_back(field(s, "source").item<int64_t>());
    ++batch.meta[kMetaSourcePrefix + std::to_string(sources.back())];  // on the host: how many of each
  }
  batch.tensors["source"] = torch::tensor(sources, torch::kInt64);
}

}  // namespace

Batch collate_tokens_padded(std::vector<Sample>& samples, int64_t pad_len) {
  auto lengths = lengths_of(samples);
  const int64_t b = static_cast<int64_t>(samples.size());
  const int64_t longest = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
  const int64_t s = pad_len > 0 ? pad_len : longest;
  if (longest > s) throw std::runtime_error(fmt::format("pad_to_max: a sequence of {} tokens exceeds max_seq_len {}", longest, s));
  auto tokens = torch::full({b, s}, kPadToken, torch::kInt64);
  auto targets = torch::full({b, s}, kIgnoreTarget, torch::kInt64);
  auto mask = torch::zeros({b, s}, torch::kBool);
  auto positions = torch::zeros({b, s}, torch::kInt64);
  auto* pos = positions.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n = lengths[i];
    tokens[i].narrow(0, 0, n).copy_(field(samples[i], "tokens"));
    targets[i].narrow(0, 0, n).copy_(field(samples[i], "targets"));
    mask[i].narrow(0, 0, n).fill_(true);
    for (int64_t t = 0; t < n; ++t) pos[i * s + t] = t;
    total += n;
  }
  Batch batch;
  batch.tensors = {{"tokens", tokens}, {"targets", targets}, {"padding_mask", mask}, {"position_ids", positions},
                   {"lengths", torch::tensor(lengths, torch::kInt64)}};
  batch.meta = {{"batch_size", b}, {"max_seqlen", longest}, {"num_tokens", total}, {"seq_len", s}, {"right_padded", 1}};
  add_sources(batch, samples);
  return batch;
}

Batch collate_tokens_packed(std::vector<Sample>& samples) {
  auto lengths = lengths_of(samples);
  const int64_t b = static_cast<int64_t>(samples.size());
  std::vector<torch::Tensor> tokens, targets;
  std::vector<int32_t> cu(1, 0);
  int64_t total = 0, longest = 0;
  for (int64_t i = 0; i < b; ++i) {
    tokens.push_back(field(samples[i], "tokens"));
    targets.push_back(field(samples[i], "targets"));
    total += lengths[i];
    longest = std::max(longest, lengths[i]);
    if (total > INT32_MAX) throw std::runtime_error("pack: more than 2^31 tokens in a batch");
    cu.push_back(static_cast<int32_t>(total));
  }
  auto positions = torch::empty({total}, torch::kInt64);
  auto* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t t = 0; t < lengths[i]; ++t) *pos++ = t;
  Batch batch;
  batch.tensors = {{"tokens", b ? torch::cat(tokens) : torch::empty({0}, torch::kInt64)},
                   {"targets", b ? torch::cat(targets) : torch::empty({0}, torch::kInt64)},
                   {"position_ids", positions},
                   {"cu_seqlens", torch::tensor(cu, torch::kInt32)},
                   {"lengths", torch::tensor(lengths, torch::kInt64)}};
  batch.meta = {{"batch_size", b}, {"max_seqlen", longest}, {"num_tokens", total}};
  add_sources(batch, samples);
  return batch;
}

const std::vector<std::string>& token_collate_names() {
  static const std::vector<std::string> names = {"pad_to_max", "pad_to_longest", "pack"};
  return names;
}

CollateFn make_token_collate(const std::string& strategy, int64_t max_len) {
  if (strategy == "pad_to_max") return [max_len](std::vector<Sample>& s) { return collate_tokens_padded(s, max_len); };
  if (strategy == "pad_to_longest") return [](std::vector<Sample>& s) { return collate_tokens_padded(s, 0); };
  if (strategy == "pack") return [](std::vector<Sample>& s) { return collate_tokens_packed(s); };
  throw std::invalid_argument("collate: expected pad_to_max, pad_to_longest or pack, got '" + strategy + "'");
}

}  // namespace strobe::data
