// token_file: nanoGPT-style token files (a flat array of little-endian uint16 or uint32 token ids,
// e.g. train.bin / val.bin), memory-mapped, so a file of any size costs no RAM up front.
//   mode: documents  the stream is cut after every eot_token (the token ends its document, as
//                    nanoGPT's prepare scripts append it); each document into pieces of at most
//                    max_seq_len + 1 tokens; a piece of n tokens is a sample of n - 1 (tokens =
//                    piece[0, n-1), targets = piece[1, n)) for the pad / pack collates. Pieces
//                    under two tokens are dropped (a lone end-of-text).
//   mode: windows    sample i = the fixed window starting at i * max_seq_len (max_seq_len + 1
//                    tokens, so targets reach one past), the last partial window dropped.
//   packing: best_fit  (documents mode) each epoch's documents placed into rows of max_seq_len tokens
//                    by best fit (strobe/data/packing.h); a batch is batch_size rows, given to the model
//                    as the pack collate's sequences (the documents).
// Validation: val_path, or else the last val_fraction of the samples. With vocab_size > 0 every token
// is checked (one pass at setup). Bad data (DataError naming the file): missing or unreadable file,
// an empty file, a size that is not a multiple of the token width, a token >= vocab_size.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/mapped_file.h"
#include "strobe/core/datamodule.h"
#include "strobe/data/collate_tokens.h"
#include "strobe/data/data_error.h"
#include "strobe/data/dataset.h"
#include "strobe/data/mix.h"

namespace strobe::data {
namespace {

class MappedTokens {
 public:
  MappedTokens(const std::string& path, int width) : path_(path), width_(width), map_(open(path)) {
    const uint64_t bytes = map_->size();
    if (bytes == 0) throw DataError(fmt::format("{}: empty token file", path));
    if (bytes % width != 0)
      throw DataError(fmt::format("{}: {} bytes is not a multiple of the {}-byte token width (dtype uint{}); truncated, or the wrong dtype",
                                  path, bytes, width, width * 8));
    map_->advise_random();
  }

  int64_t size() const { return static_cast<int64_t>(map_->size() / width_); }
  uint32_t at(int64_t i) const {
    if (width_ == 2) {
      uint16_t v;
      std::memcpy(&v, map_->data() + 2 * i, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, map_->data() + 4 * i, 4);
    return v;
  }
  torch::Tensor slice(int64_t begin, int64_t n) const {
    auto t = torch::empty({n}, torch::kInt64);
    auto* o = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) o[i] = at(begin + i);
    return t;
  }
  const std::string& path() const { return path_; }

 private:
  static std::unique_ptr<checkpoint::MappedFile> open(const std::string& path) {
    try {
      return std::make_unique<checkpoint::MappedFile>(path);
    } catch (const checkpoint::CheckpointError& e) {  // a data file: the same message as a data error
      throw DataError(e.what());
    }
  }

  std::string path_;
  int width_;
  std::unique_ptr<checkpoint::MappedFile> map_;
};

struct Layout {
  bool documents = true;
  int64_t max_len = 1024;
  int64_t eot = 50256;
};

// Sample ranges [begin, end) of a token stream (documents mode), or the window count. `largest`:
// the largest token id seen; `docs`: each piece's document (0-based, counted by end-of-text tokens).
std::vector<std::pair<int64_t, int64_t>> cut_documents(const MappedTokens& m, const Layout& l, int64_t vocab,
                                                       uint32_t& largest, std::vector<int64_t>* docs = nullptr) {
  std::vector<std::pair<int64_t, int64_t>> pieces;
  const int64_t n = m.size(), piece = l.max_len + 1;
  int64_t doc = 0;
  auto add = [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; s += piece)
      if (std::min(e, s + piece) - s >= 2) {
        pieces.emplace_back(s, std::min(e, s + piece));
        if (docs) docs->push_back(doc);
      }
  };
  int64_t begin = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t t = m.at(i);
    largest = std::max(largest, t);
    if (vocab > 0 && t >= vocab) throw DataError(fmt::format("{}: token {} at position {} is not below vocab_size {}", m.path(), t, i, vocab));
    if (l.documents && t == l.eot) {
      add(begin, i + 1);
      begin = i + 1;
      ++doc;
    }
  }
  if (l.documents) add(begin, n);
  return pieces;
}

class TokenSamples : public Dataset {
 public:
  // documents: explicit pieces; windows: `count` windows starting at window `first`.
  TokenSamples(std::shared_ptr<const MappedTokens> m, std::vector<std::pair<int64_t, int64_t>> pieces, std::vector<int64_t> docs)
      : m_(std::move(m)), pieces_(std::move(pieces)), docs_(std::move(docs)), count_(static_cast<int64_t>(pieces_.size())) {}
  TokenSamples(std::shared_ptr<const MappedTokens> m, int64_t max_len, int64_t first, int64_t count)
      : m_(std::move(m)), windows_(true), max_len_(max_len), first_(first), count_(count) {}
  int64_t size() const override { return count_; }
  Sample get(int64_t index, at::Generator&) const override {
    int64_t b, e;
    if (windows_) {
      b = (first_ + index) * max_len_;
      e = b + max_len_ + 1;
    } else {
      std::tie(b, e) = pieces_.at(index);
    }
    auto seq = m_->slice(b, e - b);
    return {{"tokens", seq.narrow(0, 0, e - b - 1)}, {"targets", seq.narrow(0, 1, e - b - 1)}};
  }
  int64_t sample_length(int64_t index) const override {
    if (windows_) return max_len_;
    const auto [b, e] = pieces_.at(index);
    return e - b - 1;
  }
  // The file, the document (documents mode) or window, and the token offsets the sample holds.
  std::string describe(int64_t index) const override {
    if (windows_) {
      const int64_t b = (first_ + index) * max_len_;
      return fmt::format("{}: window {}, tokens {}-{}", m_->path(), first_ + index, b, b + max_len_);
    }
    const auto [b, e] = pieces_.at(index);
    return fmt::format("{}: document {}, tokens {}-{}", m_->path(), docs_.at(index), b, e - 1);
  }

 private:
  std::shared_ptr<const MappedTokens> m_;
  std::vector<std::pair<int64_t, int64_t>> pieces_;
  std::vector<int64_t> docs_;
  bool windows_ = false;
  int64_t max_len_ = 0, first_ = 0, count_ = 0;
};

struct Source {
  std::string name, path, val_path;
  double weight = 1;
};

// data.sources: a weighted mix of token files (mix.h), or the one file of data.path.
std::vector<Source> read_sources(config::Section& cfg) {
  if (!cfg.has("sources")) return {{"", cfg.require_string("path"), cfg.get_string("val_path", ""), 1.0}};
  if (cfg.has("path")) cfg.fail("path", "give either path or sources, not both");
  if (cfg.has("val_path")) cfg.fail("val_path", "with sources, each source has its own val_path");
  std::vector<Source> out;
  auto list = cfg.list("sources", "a mapping with a 'path'");
  if (list.empty()) cfg.fail("sources", "expected at least one source");
  for (auto& src : list) {
    Source s;
    s.path = src.require_string("path");
    s.weight = src.get_double("weight", 1.0);
    if (!(s.weight > 0) || !std::isfinite(s.weight)) src.fail("weight", fmt::format("expected a finite number > 0, got {}", s.weight));
    s.name = src.get_string("name", std::filesystem::path(s.path).stem().string());
    s.val_path = src.get_string("val_path", "");
    src.finish();
    for (size_t k = 0; k < out.size(); ++k)
      if (out[k].name == s.name)
        src.fail("name", fmt::format("'{}' is also the name of source {} ({}); names the sources apart", s.name, k, out[k].path));
    out.push_back(s);
  }
  return out;
}

// What scripts/tokenize_text.py writes beside a token file (<file>.json): its dtype, vocabulary and
// end-of-text id, so a config need not repeat them (docs/DATA.md, "Tokenizing text").
struct Sidecar {
  std::string path, dtype;
  int64_t vocab_size = 0, eot_token = 0;
};

std::optional<Sidecar> read_sidecar(const std::string& file) {
  const std::string path = file + ".json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  std::ifstream in(path);
  auto j = nlohmann::json::parse(in, nullptr, false);
  Sidecar s;
  s.path = path;
  try {
    if (!j.is_object() || j.value("format", "") != "strobe token file") throw std::runtime_error("");
    s.dtype = j.at("dtype").get<std::string>();
    s.vocab_size = j.at("vocab_size").get<int64_t>();
    s.eot_token = j.at("eot_token").get<int64_t>();
  } catch (const std::exception&) {
    throw DataError(fmt::format("{}: not a token file's sidecar (scripts/tokenize_text.py writes one: format, dtype, "
                                "vocab_size, eot_token)",
                                path));
  }
  if (s.dtype != "uint16" && s.dtype != "uint32") throw DataError(fmt::format("{}: dtype '{}' is not uint16 or uint32", path, s.dtype));
  return s;
}

std::shared_ptr<DataModule> make_token_file(config::Section& cfg, const DataContext& ctx) {
  const std::vector<Source> sources = read_sources(cfg);
  const bool mixed = !sources[0].name.empty();
  const std::string val_path = mixed ? std::string() : sources[0].val_path;  // a mix: each source's own
  // The sidecars of the files: they must agree with each other, and the config with them; what the
  // config leaves out comes from them.
  std::optional<Sidecar> side;
  for (const auto& src : sources)
    for (const std::string& f : {src.path, src.val_path}) {
      if (f.empty()) continue;
      auto s = read_sidecar(f);
      if (!s) continue;
      if (side && (s->dtype != side->dtype || s->vocab_size != side->vocab_size || s->eot_token != side->eot_token))
        throw DataError(fmt::format("{} says dtype {}, vocab_size {}, eot_token {}, but {} says {}, {}, {}: files of other "
                                    "tokenizers cannot be mixed",
                                    s->path, s->dtype, s->vocab_size, s->eot_token, side->path, side->dtype, side->vocab_size,
                                    side->eot_token));
      side = s;
    }
  // (Whether the config sets a key is read before its value: reading stores the default.)
  const std::set<std::string> set_keys = [&] {
    std::set<std::string> out;
    for (const char* k : {"dtype", "eot_token", "vocab_size"})
      if (cfg.has(k)) out.insert(k);
    return out;
  }();
  auto agree = [&](const char* key, const std::string& mine, const std::string& theirs) {
    if (side && set_keys.count(key) && mine != theirs)
      cfg.fail(key, fmt::format("{}, but {} (the token file's sidecar) says {}", mine, side->path, theirs));
  };
  const std::string dtype = cfg.get_choice("dtype", side ? side->dtype : "uint16", {"uint16", "uint32"});
  Layout l;
  l.documents = cfg.get_choice("mode", "documents", {"documents", "windows"}) == "documents";
  l.max_len = cfg.get_int("max_seq_len", 1024, 1);
  l.eot = cfg.get_int("eot_token", side ? side->eot_token : 50256, 0, UINT32_MAX);
  const int64_t vocab = cfg.get_int("vocab_size", side ? side->vocab_size : 0, 0, int64_t(UINT32_MAX) + 1);
  if (side) {
    agree("dtype", dtype, side->dtype);
    agree("eot_token", std::to_string(l.eot), std::to_string(side->eot_token));
    agree("vocab_size", std::to_string(vocab), std::to_string(side->vocab_size));
  }
  const double val_fraction = cfg.get_double("val_fraction", val_path.empty() ? 0.05 : 0.0, 0.0, 0.5);
  if (!val_path.empty() && val_fraction > 0) cfg.fail("val_fraction", "give either val_path or val_fraction, not both");
  // data.packing: best_fit places the documents into rows of max_seq_len (strobe/data/packing.h); a
  // batch is then data.batch_size rows, packed (attention stays within each document).
  const bool best_fit = cfg.get_choice("packing", "none", {"none", "best_fit"}) == "best_fit";
  if (best_fit && !l.documents) cfg.fail("packing", "best_fit packs documents: it needs mode: documents (windows are full rows already)");
  const std::string collate =
      cfg.get_choice("collate", best_fit ? "pack" : l.documents ? "pad_to_longest" : "pad_to_max", token_collate_names());
  if (best_fit && collate != "pack")
    cfg.fail("collate", fmt::format("'{}' with packing: best_fit; a packed row's documents go to the model as the pack collate's sequences "
                                    "(collate: pack, the default with it)",
                                    collate));
  LoaderOptions opt = read_loader_options(cfg, ctx, 32);
  if (best_fit) opt.pack_row_len = l.max_len;
  cfg.finish();
  const int width = dtype == "uint16" ? 2 : 4;

  // The largest token id of each file, so that a model's vocabulary is checked against the data
  // before the first step even when data.vocab_size is unset.
  uint32_t largest = 0;
  std::string largest_in;
  auto note_largest = [&](const std::string& p, uint32_t file_largest) {
    if (largest_in.empty() || file_largest > largest) largest = file_largest, largest_in = p;
  };
  auto split = [&](const std::string& p, double fraction) -> std::pair<std::shared_ptr<Dataset>, std::shared_ptr<Dataset>> {
    auto m = std::make_shared<const MappedTokens>(p, width);
    uint32_t file_largest = 0;
    if (l.documents) {
      std::vector<int64_t> docs;
      auto pieces = cut_documents(*m, l, vocab, file_largest, &docs);
      note_largest(p, file_largest);
      if (pieces.empty()) throw DataError(fmt::format("{}: no document of two tokens or more", p));
      const auto n_val = static_cast<int64_t>(static_cast<double>(pieces.size()) * fraction);
      std::vector<std::pair<int64_t, int64_t>> a(pieces.begin(), pieces.end() - n_val), b(pieces.end() - n_val, pieces.end());
      std::vector<int64_t> da(docs.begin(), docs.end() - n_val), db(docs.end() - n_val, docs.end());
      return {std::make_shared<TokenSamples>(m, std::move(a), std::move(da)),
              n_val ? std::make_shared<TokenSamples>(m, std::move(b), std::move(db)) : nullptr};
    }
    cut_documents(*m, Layout{false, l.max_len, l.eot}, vocab, file_largest);  // the vocabulary checks only
    note_largest(p, file_largest);
    const int64_t windows = (m->size() - 1) / l.max_len;
    if (windows < 1) throw DataError(fmt::format("{}: {} tokens is less than one window of max_seq_len + 1 = {}", p, m->size(), l.max_len + 1));
    const auto n_val = static_cast<int64_t>(static_cast<double>(windows) * fraction);
    return {std::make_shared<TokenSamples>(m, l.max_len, 0, windows - n_val),
            n_val ? std::make_shared<TokenSamples>(m, l.max_len, windows - n_val, n_val) : nullptr};
  };
  std::shared_ptr<Dataset> train, val;
  if (!mixed) {
    const std::string& path = sources[0].path;
    std::tie(train, val) = split(path, val_fraction);
    if (train->size() == 0) throw DataError(fmt::format("{}: val_fraction leaves no training sample", path));
    if (!val_path.empty()) val = split(val_path, 0.0).first;
  } else {
    // Each source's samples as one file's, then the mix (the schedule: mix.h); validation holds every
    // source's validation samples.
    std::vector<MixSource> mix, vals;
    for (const auto& src : sources) {
      auto [t, v] = split(src.path, src.val_path.empty() ? val_fraction : 0.0);
      if (t->size() == 0) throw DataError(fmt::format("{} (source {}): val_fraction leaves no training sample", src.path, src.name));
      if (!src.val_path.empty()) v = split(src.val_path, 0.0).first;
      mix.push_back({src.name, src.weight, t});
      if (v) vals.push_back({src.name, src.weight, v});
    }
    train = std::make_shared<MixDataset>(std::move(mix));
    if (!vals.empty()) val = std::make_shared<MixDataset>(std::move(vals), /*mix=*/false);
  }
  auto dm = std::make_shared<DatasetDataModule>(train, val, val, make_token_collate(collate, l.max_len), opt);
  DataInfo info;
  if (vocab > 0) {
    info.vocab_size = vocab, info.vocab_size_key = "vocab_size";
  } else {
    info.vocab_size = static_cast<int64_t>(largest) + 1;
    info.vocab_size_source = fmt::format("the largest token id in {} is {}", largest_in, largest);
  }
  info.max_seq_len = l.max_len, info.max_seq_len_key = "max_seq_len";
  info.batch_keys = {"tokens", "targets"};
  if (mixed)
    for (const auto& src : sources) info.source_names.push_back(src.name);
  dm->set_info(info);
  return dm;
}

STROBE_REGISTER(data_registry(), "token_file", make_token_file);

}  // namespace
}  // namespace strobe::data
