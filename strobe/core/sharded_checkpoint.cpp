#include "strobe/core/sharded_checkpoint.h"

#include <filesystem>
#include <functional>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "strobe/core/checkpoint_view.h"
#include "strobe/core/fault_points.h"
#include "strobe/core/optimizer_reshard.h"
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
    if (rank != 0) return;
    checkpoint::save_checkpoint_file(path, d);
    // A whole file that replaced a sharded one (a zero2 checkpoint resumed under ddp or in one
    // process, in its run directory): the old save's shards are nobody's any more.
    if (std::error_code ec; fs::exists(path + kFolderSuffix, ec)) checkpoint::remove_tree(path + kFolderSuffix);
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

std::optional<checkpoint::CheckpointData> ShardedCheckpoint::for_resume(const checkpoint::CheckpointData& d,
                                                                         const OptimizerShapes& shapes) const {
  // One process replaying a zero2 rank's capture: its optimizer state is that rank's shard, which
  // fits no whole optimizer: the step restarts the moments (the forward and backward are the captured ones).
  if (!sharded_ && strategy_.world_size() == 1 && d.has_blob(kShardBlob) && !d.has_blob(kManifestBlob)) {
    checkpoint::CheckpointData own = d;
    own.blobs[checkpoint_keys::kOptimizer] = std::string();
    fmt::print(stderr, "strobe: {}: one rank's state under trainer.strategy: zero2: its optimizer shard is not restored in one process (fresh moments)\n",
               d.source);
    return own;
  }
  if (sharded_ || d.has_blob(kManifestBlob)) return with_own_shard(d, shapes);
  return std::nullopt;
}

checkpoint::CheckpointData ShardedCheckpoint::with_own_shard(const checkpoint::CheckpointData& d,
                                                             const OptimizerShapes& shapes) const {
  const std::string& source = d.source;
  const int64_t rank = strategy_.rank(), world = strategy_.world_size();
  // A refusal every rank reaches alike (the same files, the same checks): end in order, then the
  // same exit 2 everywhere.
  auto refuse = [&](const std::string& why) {
    strategy_.shutdown();
    throw checkpoint::CheckpointError(why);
  };
  const OptimizerSharding mine{world, sharded_};
  const std::string layout =
      sharded_ ? fmt::format("zero2's shards of {} process(es)", world) : std::string("a whole optimizer state");
  // This rank's optimizer state re-cut on the host from the checkpoint's (optimizer_reshard.h).
  auto recut = [&](const OptimizerSharding& from, const std::function<std::string(int64_t)>& read,
                   const std::function<std::string(int64_t)>& what) {
    checkpoint::CheckpointData merged = d;
    try {
      merged.blobs[checkpoint_keys::kOptimizer] = reshard_optimizer_state(shapes, from, read, mine, rank, what);
    } catch (const std::runtime_error& e) {
      refuse(fmt::format("{}: its optimizer state cannot be re-cut into {}: {}", source, layout, e.what()));
    }
    return merged;
  };
  const bool manifest = d.has_blob(kManifestBlob);
  if (!manifest) {
    if (d.has_blob(kShardBlob))
      refuse(fmt::format(
          "{}: written by one rank alone (a failed step's start under trainer.strategy: zero2): it holds that rank's "
          "optimizer shard only; resume from a checkpoint every rank wrote (last.ckpt)",
          source));
    if (!d.has_blob(checkpoint_keys::kOptimizer) || d.blob(checkpoint_keys::kOptimizer).empty()) return d;  // said later
    // A whole state (ddp, one process): this rank's rows of it.
    return recut(OptimizerSharding{1, false}, [&](int64_t) { return d.blob(checkpoint_keys::kOptimizer); },
                 [&](int64_t) { return source + "'s optimizer state"; });
  }
  auto m = nlohmann::json::parse(d.blob(kManifestBlob), nullptr, false);
  const int64_t saved = m.is_object() ? m.value("world_size", int64_t{0}) : 0;
  if (!m.is_object() || saved < 1 || !m.contains("files") || !m["files"].is_array() ||
      m["files"].size() != static_cast<size_t>(saved) || !m.contains("tag") || !m["tag"].is_string())
    refuse(fmt::format("{}: its zero2 manifest (blob '{}') is malformed", source, kManifestBlob));
  const fs::path base = fs::path(source).parent_path();
  const std::string tag = m["tag"].get<std::string>();
  // Every rank checks every shard file, so a missing one stops all ranks alike (exit 2).
  for (const auto& f : m["files"])
    if (!f.is_string() || !fs::exists(base / f.get<std::string>()))
      refuse(fmt::format("{}: the optimizer shard {} its manifest names is missing", source,
                         f.is_string() ? (base / f.get<std::string>()).string() : f.dump()));
  auto shard_path = [&](int64_t r) { return (base / m["files"][r].get<std::string>()).string(); };
  // Shard file r, checked against the manifest: rank r's optimizer shard of this save.
  auto read_shard = [&](int64_t r, const std::function<void(const std::string&)>& bad) {
    const std::string path = shard_path(r);
    auto shard = checkpoint::load_checkpoint_file(path);
    auto info = nlohmann::json::parse(shard.has_blob(kShardBlob) ? shard.blob(kShardBlob) : "", nullptr, false);
    if (!info.is_object() || info.value("rank", int64_t{-1}) != r || info.value("tag", std::string()) != tag ||
        info.value("world_size", int64_t{-1}) != saved || !shard.has_blob(checkpoint_keys::kOptimizer))
      bad(fmt::format("{}: {} is not rank {}'s optimizer shard of this checkpoint (save tag {}, {} process(es))", source, path,
                      r, tag, saved));
    return shard.blob(checkpoint_keys::kOptimizer);
  };
  if (sharded_ && saved == world) {  // the same cut: this rank's own file, as it was written
    checkpoint::CheckpointData merged = d;
    merged.blobs[checkpoint_keys::kOptimizer] =
        read_shard(rank, [](const std::string& why) { throw checkpoint::CheckpointError(why); });
    return merged;
  }
  // Another number of processes or a whole state: every rank reads every shard (one at a time) and
  // keeps its own rows; a shard that is not what the manifest says stops every rank alike.
  const int64_t step = CheckpointView(d, source).meta().global_step.value_or(0);
  return recut(
      OptimizerSharding{saved, true},
      [&](int64_t r) {
        std::string blob = read_shard(r, refuse);
        if (r == 0) fault_point("zero2_recut", step);
        return blob;
      },
      [&](int64_t r) { return shard_path(r); });
}

}  // namespace strobe
