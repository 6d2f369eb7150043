// synthetic_tokens: the seed's variable-length LM data (varlen-transformer.txt). Sample i: a length
// L uniform in [1, max_seq_len) (with fixed_length: true, L = max_seq_len, as a benchmark of full
// sequences wants), then L + 1 tokens uniform in [1, vocab_size) (0 is the pad token); tokens = the
// first L, targets = the last L. All draws come from the per-sample generator.
#include <fmt/format.h>
#include <torch/torch.h>

#include "data/synthetic_rng.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/collate_tokens.h"
#include "strobe/data/dataset.h"

namespace strobe::data {
namespace {

class SyntheticTokens : public Dataset {
 public:
  SyntheticTokens(int64_t size, int64_t vocab, int64_t max_len, bool fixed, uint64_t salt)
      : size_(size), vocab_(vocab), max_len_(max_len), fixed_(fixed), salt_(salt) {}
  int64_t size() const override { return size_; }
  Sample get(int64_t /*index*/, at::Generator& gen) const override {
    SampleRng rng(gen, salt_);
    const int64_t length = fixed_ ? max_len_ : max_len_ > 1 ? rng.uniform_int(1, max_len_) : 1;
    auto seq = torch::empty({length + 1}, torch::kInt64);
    auto* p = seq.data_ptr<int64_t>();
    for (int64_t i = 0; i <= length; ++i) p[i] = rng.uniform_int(1, vocab_);
    return {{"tokens", seq.narrow(0, 0, length)}, {"targets", seq.narrow(0, 1, length)}};
  }

 private:
  int64_t size_, vocab_, max_len_;
  bool fixed_;
  uint64_t salt_;
};

std::shared_ptr<DataModule> make_synthetic_tokens(config::Section& cfg, const DataContext& ctx) {
  const int64_t vocab = cfg.get_int("vocab_size", 1024, 2);
  const int64_t max_len = cfg.get_int("max_seq_len", 1024, 1);
  const int64_t num_samples = cfg.get_int("num_samples", 32 * 100, 1);
  const int64_t num_val = cfg.get_int("num_val_samples", 256, 0);
  const bool fixed = cfg.get_bool("fixed_length", false);
  const std::string collate = cfg.get_choice("collate", "pad_to_max", token_collate_names());
  LoaderOptions opt = read_loader_options(cfg, ctx, 32);
  cfg.finish();
  // Val/test: the same distribution, other draws (a per-split salt on the per-sample generator).
  auto train = std::make_shared<SyntheticTokens>(num_samples, vocab, max_len, fixed, 0);
  std::shared_ptr<Dataset> val;
  if (num_val > 0) val = std::make_shared<SyntheticTokens>(num_val, vocab, max_len, fixed, 1);
  auto test = std::make_shared<SyntheticTokens>(std::max<int64_t>(num_val, 1), vocab, max_len, fixed, 2);
  auto dm = std::make_shared<DatasetDataModule>(train, val, test, make_token_collate(collate, max_len), opt);
  DataInfo info;
  info.vocab_size = vocab, info.vocab_size_key = "vocab_size";
  info.max_seq_len = max_len, info.max_seq_len_key = "max_seq_len";
  info.batch_keys = {"tokens", "targets"};
  dm->set_info(info);
  return dm;
}

STROBE_REGISTER(data_registry(), "synthetic_tokens", make_synthetic_tokens);

}  // namespace
}  // namespace strobe::data
