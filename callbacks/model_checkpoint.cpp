// model_checkpoint: last.ckpt, the top-k checkpoints by a monitored metric, and every n steps.
// Keys: monitor (none: the k most recent), mode (min|max), save_top_k (1; -1 all; 0 none),
// save_last (true), every_n_steps (0: off), every_n_epochs (1), dirpath (<run>/checkpoints).
//
// The top-k list holds paths relative to the run directory, so a run directory that was moved or
// copied resumes with its own files: it never deletes the original's. A `dirpath` outside the run
// directory is kept as an absolute path with the run directory that wrote it, and only files this
// run directory wrote there are ever deleted. `strobe fit` claims such a directory for the run
// before it starts (runner/run_dir.h, CheckpointDirClaim): never another run's, locked while it runs.
#include <filesystem>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/callback.h"
#include "strobe/core/fault_points.h"
#include "strobe/core/trainer_view.h"

namespace strobe {
namespace {

class ModelCheckpoint : public Callback {
 public:
  std::string name() const override { return "model_checkpoint"; }
  std::string state_key() const override { return fmt::format("model_checkpoint[monitor={},mode={}]", monitor_, mode_); }
  std::string checkpoint_dir() const override { return dirpath_; }

  ModelCheckpoint(std::string monitor, std::string mode, int64_t top_k, bool save_last, int64_t every_n_steps,
                  int64_t every_n_epochs, std::string dirpath)
      : monitor_(std::move(monitor)), mode_(std::move(mode)), top_k_(top_k), save_last_(save_last),
        every_n_steps_(every_n_steps), every_n_epochs_(every_n_epochs), dirpath_(std::move(dirpath)) {}

  void on_fit_start(TrainerView& t, Module&) override {
    if (!enabled(t) || !t.is_global_zero()) return;  // rank 0 alone writes checkpoints
    auto stale = checkpoint::remove_stale_temp_files(dir(t));
    if (!stale.empty())
      fmt::print(stderr, "strobe: removed {} partial checkpoint(s) a killed writer left in {}\n", stale.size(), dir(t));
  }

  // Validation and the epoch's end are only noted; the files are written once the step has logged
  // everything (on_train_batch_complete), so a checkpoint is named and ranked by its own step's
  // validation and holds its whole log.
  void on_validation_end(TrainerView& t, Module&) override {
    if (!enabled(t) || t.sanity_checking() || monitor_.empty() || every_n_steps_ > 0) return;
    if (!value(t)) {
      std::string known;
      for (const auto& kv : t.metrics()) known += (known.empty() ? "" : ", ") + kv.first;
      throw std::runtime_error(fmt::format("model_checkpoint: monitor '{}' was not logged (logged: {})", monitor_, known));
    }
    validated_ = true;
  }

  void on_train_epoch_end(TrainerView& t, Module&) override {
    if (enabled(t)) epoch_ended_ = true;
  }

  void on_train_batch_complete(TrainerView& t, Module&) override {
    const bool validated = std::exchange(validated_, false), epoch_ended = std::exchange(epoch_ended_, false);
    if (!enabled(t)) return;
    const auto& s = t.state();
    bool saved = false;
    if (every_n_steps_ > 0) {
      // Right after the batch that completed the step (under gradient accumulation not again after
      // the next step's first micro-batches, while global_step still reads the same).
      if (s.global_step != 0 && t.accumulated_batches() == 0 && s.global_step % every_n_steps_ == 0 &&
          s.global_step != last_step_saved_) {
        saved = true;
        if (monitor_.empty()) {
          save_topk(t, static_cast<double>(s.global_step), fmt::format("step={}", s.global_step));
        } else if (auto v = t.rank0_value(value(t))) {  // data parallel: rank 0's reading decides (step values are per rank)
          save_topk(t, *v, fmt::format("step={}-{}={:.4f}", s.global_step, sanitize(monitor_), *v));
        }
      }
    } else if (validated) {
      saved = true;
      if (auto v = value(t))
        save_topk(t, *v, fmt::format("epoch={}-step={}-{}={:.4f}", s.epoch, s.global_step, sanitize(monitor_), *v));
    }
    if (epoch_ended) {
      saved = true;
      if (monitor_.empty() && every_n_steps_ <= 0 && (s.epoch + 1) % every_n_epochs_ == 0)
        save_topk(t, static_cast<double>(s.global_step), fmt::format("epoch={}-step={}", s.epoch, s.global_step));
    }
    if (!saved) return;
    fault_point("after_topk", s.global_step);
    save_last(t);
  }

  void on_train_end(TrainerView& t, Module&) override {
    if (enabled(t)) save_last(t);
  }

  std::optional<SavedCheckpoint> best_checkpoint(const std::string& run_dir) const override {
    if (best_path_.empty()) return std::nullopt;
    SavedCheckpoint c;
    c.path = writers_.count(best_path_) ? best_path_ : run_dir + "/" + best_path_;
    c.monitor = monitor_;
    if (auto it = best_k_.find(best_path_); it != best_k_.end()) c.score = it->second;
    return c;
  }

  // best_k / best_path: run-relative paths (outside the run directory: absolute, with their writer
  // in "writers"); best_checkpoint() resolves them.
  nlohmann::json state_dict() const override {
    return {{"best_k", best_k_},   {"best_path", best_path_}, {"writers", writers_}, {"paths", "run-relative"},
            {"last_step_saved", last_step_saved_}, {"monitor", monitor_}};
  }
  void load_state_dict(const nlohmann::json& s) override {
    best_k_ = s.at("best_k").get<std::map<std::string, double>>();
    best_path_ = s.at("best_path").get<std::string>();
    last_step_saved_ = s.at("last_step_saved").get<int64_t>();
    writers_.clear();
    if (s.value("paths", "") == "run-relative") {
      writers_ = s.at("writers").get<std::map<std::string, std::string>>();
      return;
    }
    // A checkpoint whose paths are as the run directory was spelled when it was written: the files
    // of <run>/checkpoints become run-relative; any other is kept in the list but never deleted.
    std::map<std::string, double> converted;
    std::string best;
    for (const auto& [path, score] : best_k_) {
      std::filesystem::path p(path);
      std::string key = path;
      if (dirpath_.empty() && p.parent_path().filename() == "checkpoints")
        key = "checkpoints/" + p.filename().string();
      else
        writers_[key] = "";  // unknown writer: never deleted
      converted[key] = score;
      if (path == best_path_) best = key;
    }
    best_k_ = std::move(converted);
    best_path_ = best;
  }

 private:
  static std::string sanitize(std::string s) {
    for (auto& ch : s)
      if (ch == '/') ch = '_';
    return s;
  }
  bool enabled(const TrainerView& t) const {
    return !t.run_dir().empty() && t.config().enable_checkpointing && t.config().fast_dev_run == 0;
  }
  std::string dir(const TrainerView& t) const { return dirpath_.empty() ? t.run_dir() + "/checkpoints" : dirpath_; }
  static std::filesystem::path absolute_of(const std::string& p) { return std::filesystem::absolute(p).lexically_normal(); }
  // The key a checkpoint file is kept under: relative to the run directory when it lies inside it
  // (decided from the paths alone, the same on every rank); otherwise absolute, with its writer.
  std::string key_of(const TrainerView& t, const std::string& file) {
    const auto run = absolute_of(t.run_dir());
    const auto abs = absolute_of(file);
    const auto rel = abs.lexically_relative(run);
    if (!rel.empty() && *rel.begin() != "..") return rel.string();
    writers_[abs.string()] = run.string();
    return abs.string();
  }
  std::string resolve(const TrainerView& t, const std::string& key) const {
    return writers_.count(key) ? key : t.run_dir() + "/" + key;
  }
  // Inside the run directory: always this run's. Outside: only what this run directory wrote.
  bool ours(const TrainerView& t, const std::string& key) const {
    auto it = writers_.find(key);
    return it == writers_.end() || (!it->second.empty() && it->second == absolute_of(t.run_dir()).string());
  }
  std::optional<double> value(const TrainerView& t) const {
    auto it = t.metrics().find(monitor_);
    if (it == t.metrics().end()) return std::nullopt;
    return it->second;
  }
  // Without a monitor the score is the step: the newest checkpoints are the ones kept, whatever `mode`.
  bool better(double a, double b) const { return (monitor_.empty() || mode_ == "max") ? a > b : a < b; }

  void save_topk(TrainerView& t, double score, const std::string& stem) {
    if (top_k_ == 0) return;
    if (std::isnan(score)) return;
    std::string path = fmt::format("{}/{}.ckpt", dir(t), stem);
    if (top_k_ > 0 && static_cast<int64_t>(best_k_.size()) >= top_k_) {
      auto worst = best_k_.begin();
      for (auto it = best_k_.begin(); it != best_k_.end(); ++it)
        if (better(worst->second, it->second)) worst = it;
      if (!better(score, worst->second)) return;
      if (t.is_global_zero() && ours(t, worst->first)) checkpoint::remove_checkpoint(resolve(t, worst->first));
      writers_.erase(worst->first);
      best_k_.erase(worst);
    }
    save(t, path);
    const std::string key = key_of(t, path);
    best_k_[key] = score;
    auto best = best_k_.begin();
    for (auto it = best_k_.begin(); it != best_k_.end(); ++it)
      if (better(it->second, best->second)) best = it;
    best_path_ = best->first;
  }

  void save_last(TrainerView& t) {
    if (!save_last_ || t.state().global_step == last_step_saved_) return;
    last_step_saved_ = t.state().global_step;
    save(t, dir(t) + "/last.ckpt");
  }

  // Every logged row up to this step reaches metrics.csv and the TensorBoard file before the
  // checkpoint exists: after a crash, the logs cover at least everything the checkpoint resumes from.
  static void save(TrainerView& t, const std::string& path) {
    t.drain_metrics();
    t.save_checkpoint(path);
  }

  std::string monitor_, mode_;
  int64_t top_k_;
  bool save_last_;
  int64_t every_n_steps_, every_n_epochs_;
  std::string dirpath_;
  std::map<std::string, double> best_k_;
  std::string best_path_;
  std::map<std::string, std::string> writers_;  // kept files outside the run directory -> the run directory that wrote them
  int64_t last_step_saved_ = -1;
  bool validated_ = false, epoch_ended_ = false;  // during the current step
};

std::shared_ptr<Callback> make_model_checkpoint(config::Section& cfg) {
  std::string monitor = cfg.get_string("monitor", "");
  std::string mode = cfg.get_choice("mode", "min", {"min", "max"});
  int64_t k = cfg.get_int("save_top_k", 1, -1);
  bool last = cfg.get_bool("save_last", true);
  int64_t n = cfg.get_int("every_n_steps", 0, 0);
  int64_t e = cfg.get_int("every_n_epochs", 1, 1);
  std::string dirpath = cfg.get_string("dirpath", "");
  cfg.finish();
  return std::make_shared<ModelCheckpoint>(monitor, mode, k, last, n, e, dirpath);
}

STROBE_REGISTER(callback_registry(), "model_checkpoint", make_model_checkpoint);

}  // namespace
}  // namespace strobe
