#include "strobe/core/capture.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/checkpoint_keys.h"

namespace strobe::capture {

namespace fs = std::filesystem;
namespace keys = checkpoint_keys;

void put_batches(checkpoint::CheckpointData& out, const std::vector<Batch>& batches) {
  nlohmann::json metas = nlohmann::json::array(), indices = nlohmann::json::array();
  for (size_t i = 0; i < batches.size(); ++i) {
    for (const auto& [key, t] : batches[i].tensors) out.tensors[keys::capture_batch(i, key)] = t;
    metas.push_back(batches[i].meta);
    indices.push_back(batches[i].indices);
  }
  out.blobs[keys::kCaptureBatches] = metas.dump();
  out.blobs[keys::kCaptureIndices] = indices.dump();  // each row's dataset index (Batch::indices)
}

std::vector<Batch> get_batches(const checkpoint::CheckpointData& in) {
  // Every part checked: a damaged capture is refused naming what is wrong, never a library's exception.
  const nlohmann::json metas = nlohmann::json::parse(in.blob(keys::kCaptureBatches), nullptr, false);
  if (!metas.is_array()) throw checkpoint::CheckpointError("the capture's batch record (blob 'capture_batches') is not a JSON list");
  if (metas.empty()) throw checkpoint::CheckpointError("the capture holds no batches");
  std::vector<Batch> out(metas.size());
  for (size_t i = 0; i < out.size(); ++i) {
    if (!metas[i].is_object()) throw checkpoint::CheckpointError(fmt::format("the record of batch {} is not a JSON object", i));
    for (const auto& [k, v] : metas[i].items()) {
      if (!v.is_number_integer()) throw checkpoint::CheckpointError(fmt::format("the record of batch {}: '{}' is not an integer", i, k));
      out[i].meta[k] = v.get<int64_t>();
    }
  }
  for (const auto& [name, t] : in.tensors) {
    const std::string prefix = keys::kCaptureBatchPrefix;
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    const size_t slash = rest.find('/');
    const std::string index = rest.substr(0, slash);
    if (slash == std::string::npos || index.empty() || index.size() > 9 ||
        index.find_first_not_of("0123456789") != std::string::npos || std::stoul(index) >= out.size())
      throw checkpoint::CheckpointError(fmt::format("capture batch tensor '{}' has no batch record", name));
    out[std::stoul(index)].tensors[rest.substr(slash + 1)] = t;
  }
  for (size_t i = 0; i < out.size(); ++i)
    if (out[i].tensors.empty()) throw checkpoint::CheckpointError(fmt::format("the capture's batch {} holds no tensors", i));
  if (in.has_blob(keys::kCaptureIndices)) {
    const nlohmann::json idx = nlohmann::json::parse(in.blob(keys::kCaptureIndices), nullptr, false);
    if (!idx.is_array() || idx.size() != out.size())
      throw checkpoint::CheckpointError("the capture's dataset indices (blob 'capture_indices') do not match its batches");
    for (size_t i = 0; i < out.size(); ++i) {
      if (!idx[i].is_array()) throw checkpoint::CheckpointError(fmt::format("the dataset indices of batch {} are not a list", i));
      for (const auto& v : idx[i]) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0)
          throw checkpoint::CheckpointError(fmt::format("the dataset indices of batch {} hold a non-index", i));
        out[i].indices.push_back(v.get<int64_t>());
      }
    }
  }
  return out;
}

std::string resolve_capture_dir(const std::string& path) {
  fs::path p(path);
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);  // a symlink loop is an error here, not an exception
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw checkpoint::CheckpointError(fmt::format("{}: cannot be read ({})", path, ec.message()));
  if (!fs::exists(st)) throw checkpoint::CheckpointError(fmt::format("{}: no such capture directory", path));
  if (!fs::is_directory(st))
    throw checkpoint::CheckpointError(fmt::format("{}: not a capture directory (give <run_dir>/nan or nan/step_<N>)", path));
  if (fs::exists(p / kCheckpointFile)) return p.string();
  fs::path best;
  int64_t best_step = -1;
  // Every call with an error code: an entry that cannot be followed (a symlink loop) is skipped, not
  // a filesystem exception.
  for (const auto& e : fs::directory_iterator(p, ec)) {
    const auto n = e.path().filename().string();
    std::error_code entry;
    if (!e.is_directory(entry) || n.rfind("step_", 0) != 0 || !fs::exists(e.path() / kCheckpointFile, entry)) continue;
    try {
      int64_t s = std::stoll(n.substr(5));
      if (s > best_step) best_step = s, best = e.path();
    } catch (const std::exception&) {
    }
  }
  if (best_step < 0)
    throw checkpoint::CheckpointError(
        fmt::format("{}: not a NaN capture (no {} here and no step_<N> capture inside)", path, kCheckpointFile));
  return best.string();
}

std::vector<std::string> remove_capture_leftovers(const std::string& base) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::is_directory(base, ec)) return removed;
  bool live_writer = false;
  std::vector<fs::path> empty_claims;
  for (const auto& e : fs::directory_iterator(base, ec)) {
    const std::string name = e.path().filename().string();
    const checkpoint::TempName state = name.rfind(".step_", 0) == 0 ? checkpoint::temp_name_state(name) : checkpoint::TempName::kNotTemp;
    if (state != checkpoint::TempName::kNotTemp && e.is_directory(ec)) {
      if (state == checkpoint::TempName::kLiveWriter) {
        live_writer = true;  // another run sharing this directory is writing its capture
        continue;
      }
      checkpoint::remove_tree(e.path().string());
      removed.push_back(name);
    } else if (name.rfind("step_", 0) == 0 && e.is_directory(ec) && fs::is_empty(e.path(), ec)) {
      empty_claims.push_back(e.path());
    }
  }
  if (!live_writer)
    for (const auto& p : empty_claims)
      if (::rmdir(p.c_str()) == 0) removed.push_back(p.filename().string());
  return removed;
}

std::string tensor_bits(const torch::Tensor& t) {
  auto c = t.to(torch::kCPU).contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  std::string out;
  for (int64_t i = 0; i < c.nbytes(); ++i) out += fmt::format("{:02x}", p[i]);
  return out;
}

}  // namespace strobe::capture
