// text_file: byte-level language-model data from any text file or directory (read recursively,
// files in sorted path order; symlinks and names ending in `skip_suffix`, default ".dat" — the
// fortune index files — are skipped), e.g. /usr/share/games/fortunes. Tokens are byte values (vocab 256).
// The corpus is cut into documents at `separator` (default "\n%\n", the fortune format; "" = no
// documents) and each document into pieces of at most max_seq_len + 1 bytes; a piece of n bytes is a
// sample of n - 1 tokens (inputs = bytes[0, n-1), targets = bytes[1, n)). Pieces shorter than two
// bytes are dropped. The last `val_fraction` of the pieces is the validation (and test) split.
// Errors (one message naming the path): missing path, unreadable file, no file in a directory,
// an empty corpus, a corpus with no piece of two bytes or more.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/datamodule.h"
#include "strobe/data/collate_tokens.h"
#include "strobe/data/data_error.h"
#include "strobe/data/dataset.h"

namespace strobe::data {
namespace {

namespace fs = std::filesystem;

std::string read_corpus(const std::string& path, const std::string& skip_suffix) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw std::runtime_error(fmt::format("{}: no such file or directory", path));
  std::vector<fs::path> files;
  if (fs::is_directory(path, ec)) {
    for (auto it = fs::recursive_directory_iterator(path, fs::directory_options::skip_permission_denied, ec);
         it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (ec) break;
      const std::string name = it->path().filename().string();
      const bool skipped = !skip_suffix.empty() && name.size() >= skip_suffix.size() &&
                           name.compare(name.size() - skip_suffix.size(), skip_suffix.size(), skip_suffix) == 0;
      if (!it->is_symlink(ec) && it->is_regular_file(ec) && !skipped) files.push_back(it->path());
    }
    if (files.empty()) throw std::runtime_error(fmt::format("{}: directory holds no regular file", path));
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::string corpus;
  for (const auto& f : files) {
    require_regular_file(f.string());
    std::ifstream in(f, std::ios::binary);
    if (!in) throw std::runtime_error(fmt::format("{}: cannot open for reading", f.string()));
    std::ostringstream ss;
    ss << in.rdbuf();
    corpus += ss.str();
  }
  if (corpus.empty()) throw std::runtime_error(fmt::format("{}: is empty (no text to train on)", path));
  return corpus;
}

// [begin, end) byte ranges of the pieces.
std::vector<std::pair<int64_t, int64_t>> cut(const std::string& text, const std::string& separator, int64_t piece_len) {
  std::vector<std::pair<int64_t, int64_t>> pieces;
  auto add_document = [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += piece_len) {
      int64_t e = std::min(end, b + piece_len);
      if (e - b >= 2) pieces.emplace_back(b, e);
    }
  };
  if (separator.empty()) {
    add_document(0, static_cast<int64_t>(text.size()));
    return pieces;
  }
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(separator, begin);
    if (end == std::string::npos) end = text.size();
    add_document(static_cast<int64_t>(begin), static_cast<int64_t>(end));
    begin = end + separator.size();
  }
  return pieces;
}

class TextPieces : public Dataset {
 public:
  TextPieces(std::shared_ptr<const torch::Tensor> bytes, std::vector<std::pair<int64_t, int64_t>> pieces)
      : bytes_(std::move(bytes)), pieces_(std::move(pieces)) {}
  int64_t size() const override { return static_cast<int64_t>(pieces_.size()); }
  Sample get(int64_t index, at::Generator&) const override {
    auto [b, e] = pieces_.at(index);
    auto seq = bytes_->narrow(0, b, e - b).to(torch::kInt64);
    return {{"tokens", seq.narrow(0, 0, e - b - 1)}, {"targets", seq.narrow(0, 1, e - b - 1)}};
  }

 private:
  std::shared_ptr<const torch::Tensor> bytes_;
  std::vector<std::pair<int64_t, int64_t>> pieces_;
};

std::shared_ptr<DataModule> make_text_file(config::Section& cfg, const DataContext& ctx) {
  const std::string path = cfg.get_string("path", "/usr/share/games/fortunes");
  const int64_t max_len = cfg.get_int("max_seq_len", 256, 1);
  const std::string separator = cfg.get_string("separator", "\n%\n");
  const std::string skip_suffix = cfg.get_string("skip_suffix", ".dat");
  const double val_fraction = cfg.get_double("val_fraction", 0.05, 0.0, 0.5);
  const std::string collate = cfg.get_choice("collate", "pad_to_longest", token_collate_names());
  LoaderOptions opt = read_loader_options(cfg, ctx, 32);
  cfg.finish();
  std::string text;
  try {
    text = read_corpus(path, skip_suffix);
  } catch (const std::runtime_error& e) {
    cfg.fail("path", e.what());
  }
  auto pieces = cut(text, separator, max_len + 1);
  if (pieces.empty()) cfg.fail("path", fmt::format("{}: no piece of two bytes or more to train on", path));
  auto bytes = std::make_shared<const torch::Tensor>(
      torch::from_blob(text.data(), {static_cast<int64_t>(text.size())}, torch::kUInt8).clone());
  const auto n_val = static_cast<int64_t>(static_cast<double>(pieces.size()) * val_fraction);
  std::vector<std::pair<int64_t, int64_t>> train_pieces(pieces.begin(), pieces.end() - n_val),
      val_pieces(pieces.end() - n_val, pieces.end());
  auto train = std::make_shared<TextPieces>(bytes, std::move(train_pieces));
  std::shared_ptr<Dataset> val;
  if (n_val > 0) val = std::make_shared<TextPieces>(bytes, val_pieces);
  auto test = std::make_shared<TextPieces>(bytes, n_val > 0 ? val_pieces : std::vector<std::pair<int64_t, int64_t>>{pieces.back()});
  auto dm = std::make_shared<DatasetDataModule>(train, val, test, make_token_collate(collate, max_len), opt);
  DataInfo info;
  info.vocab_size = 256;  // byte-level tokens
  info.max_seq_len = max_len, info.max_seq_len_key = "max_seq_len";
  info.batch_keys = {"tokens", "targets"};
  dm->set_info(info);
  return dm;
}

STROBE_REGISTER(data_registry(), "text_file", make_text_file);

}  // namespace
}  // namespace strobe::data
