#include "strobe/core/sharded_checkpoint.h"

#include <filesystem>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "strobe/core/checkpoint_view.h"
#include "strobe/core/fault_points.h"
#include "strobe/distributed/strategy.h"

namespace strobe {

namespace fs = std::filesystem;

void ShardedCheckpoint::mark(checkpoint::CheckpointData& d) const {
  if (sharded_ && d.has_blob(checkpoint_keys::kOptimizer))
    d.blobs[kShardBlob] = nlohmann::json{{"rank", strategy_.rank()}, {"world_size", strategy_.world_size()}}.dump();
}

void ShardedCheckpoint::save(const std::string& path, checkpoint::CheckpointData d, int64_t global_step) const {
  const int64_t rank = strategy_.rank(), world = strategy_.world_size();
  if (!sharded_) {
    if (rank == 0) checkpoint::save_checkpoint_file(path, d);
    return;
  }
  std::string tag;
  if (rank == 0) tag = fmt::format("step{}-{:08x}", global_step, std::random_device{}());
  tag = strategy_.broadcast_string(tag);
  const fs::path file(path);
  const std::string shard_folder = file.filename().string() + kFolderSuffix;
  auto shard_file = [&](int64_t r) { return fmt::format("{}/{}/rank{}.ckpt", shard_folder, tag, r); };
  {
    checkpoint::CheckpointData mine;
    mine.blobs[checkpoint_keys::kOptimizer] = std::move(d.blobs.at(checkpoint_keys::kOptimizer));
    auto shard = nlohmann::json::parse(d.blob(kShardBlob));
    shard["tag"] = tag;
    mine.blobs[kShardBlob] = shard.dump();
    mine.blobs[checkpoint_keys::kMeta] = d.blob(checkpoint_keys::kMeta);
    std::error_code ec;
    fs::create_directories(file.parent_path() / shard_folder / tag, ec);
    checkpoint::save_checkpoint_file((file.parent_path() / shard_file(rank)).string(), mine);
  }
  fault_point("zero2_shard_written", global_step);
  strategy_.barrier("zero2 checkpoint shards written");
  if (rank != 0) return;
  d.blobs.erase(checkpoint_keys::kOptimizer);
  d.blobs.erase(kShardBlob);
  nlohmann::json files = nlohmann::json::array();
  for (int64_t r = 0; r < world; ++r) files.push_back(shard_file(r));
  d.blobs[kManifestBlob] = nlohmann::json{{"world_size", world}, {"tag", tag}, {"files", files}}.dump();
  checkpoint::save_checkpoint_file(path, d);
  fault_point("zero2_file_written", global_step);
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(file.parent_path() / shard_folder, ec))
    if (e.path().filename() != tag) checkpoint::remove_tree(e.path().string());
}

std::optional<checkpoint::CheckpointData> ShardedCheckpoint::for_resume(const checkpoint::CheckpointData& d) const {
  // One process replaying a zero2 rank's capture: its optimizer state is that rank's shard, which
  // fits no whole optimizer: the step restarts the moments (the forward and backward are the captured ones).
  if (!sharded_ && strategy_.world_size() == 1 && d.has_blob(kShardBlob) && !d.has_blob(kManifestBlob)) {
    checkpoint::CheckpointData own = d;
    own.blobs[checkpoint_keys::kOptimizer] = std::string();
    fmt::print(stderr, "strobe: {}: one rank's state under trainer.strategy: zero2: its optimizer shard is not restored in one process (fresh moments)\n",
               d.source);
    return own;
  }
  if (sharded_ || d.has_blob(kManifestBlob)) return with_own_shard(d);
  return std::nullopt;
}

checkpoint::CheckpointData ShardedCheckpoint::with_own_shard(const checkpoint::CheckpointData& d) const {
  const std::string& source = d.source;
  const int64_t rank = strategy_.rank(), world = strategy_.world_size();
  // A refusal every rank reaches alike (the same file, the same checks): end in order, then the
  // same exit 2 everywhere.
  auto refuse = [&](const std::string& why) {
    strategy_.shutdown();
    throw checkpoint::CheckpointError(why);
  };
  const bool manifest = d.has_blob(kManifestBlob);
  if (!sharded_) {
    refuse(fmt::format(
        "{}: written under trainer.strategy: zero2, which shards the optimizer state over the ranks: resume it with "
        "zero2 and the same number of processes (its weights load with strobe validate/test/export on any number)",
        source));
  }
  if (!manifest) {
    if (d.has_blob(kShardBlob))
      refuse(fmt::format(
          "{}: written by one rank alone (a failed step's start under trainer.strategy: zero2): it holds that rank's "
          "optimizer shard only; resume from a checkpoint every rank wrote (last.ckpt)",
          source));
    refuse(fmt::format(
        "{}: its optimizer state is whole (written under trainer.strategy: ddp or by one process): resume it with ddp; "
        "trainer.strategy: zero2 resumes only its own sharded checkpoints",
        source));
  }
  auto m = nlohmann::json::parse(d.blob(kManifestBlob), nullptr, false);
  if (!m.is_object() || !m.contains("files") || !m["files"].is_array() || m["files"].size() != static_cast<size_t>(world))
    refuse(fmt::format("{}: its zero2 manifest (blob '{}') is malformed", source, kManifestBlob));
  const fs::path base = fs::path(source).parent_path();
  // Every rank checks every shard file, so a missing one stops all ranks alike (exit 2).
  for (const auto& f : m["files"])
    if (!f.is_string() || !fs::exists(base / f.get<std::string>()))
      refuse(fmt::format("{}: the optimizer shard {} its manifest names is missing", source,
                         f.is_string() ? (base / f.get<std::string>()).string() : f.dump()));
  const std::string own = (base / m["files"][rank].get<std::string>()).string();
  auto shard = checkpoint::load_checkpoint_file(own);
  auto info = nlohmann::json::parse(shard.has_blob(kShardBlob) ? shard.blob(kShardBlob) : "", nullptr, false);
  if (!info.is_object() || info.value("rank", int64_t{-1}) != rank || info.value("tag", std::string()) != m.value("tag", "") ||
      !shard.has_blob(checkpoint_keys::kOptimizer))
    throw checkpoint::CheckpointError(
        fmt::format("{}: {} is not rank {}'s optimizer shard of this checkpoint (save tag {})", source, own, rank, m.value("tag", "")));
  checkpoint::CheckpointData merged = d;
  merged.blobs[checkpoint_keys::kOptimizer] = shard.blob(checkpoint_keys::kOptimizer);
  return merged;
}

}  // namespace strobe
