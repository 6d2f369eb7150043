// on_exception_checkpoint (Lightning's OnExceptionCheckpoint): when training stops on an exception
// (a data error, a failing op, out of memory, a callback's error; not a NaN capture, which stops
// without one, and not a refusal before the first training batch), the process that raised writes
// <run>/checkpoints/<filename>.ckpt atomically: weights, optimizer, loop counters and RNG as of the
// last completed step, a checkpoint `strobe fit --ckpt` resumes exactly (one process).
//
// Which state: an exception inside a step (from its first micro-batch's start to its update) leaves
// the live state part-way (BatchNorm statistics moved by the forward, random draws taken, a partial
// accumulation), so the checkpoint takes the step start's snapshot (loop_state.h, StepStart) for the
// loop counters, generators and buffers, with the live weights and optimizer (the update was not
// applied). Between steps (the loader's next batch, validation) the live state is the last completed
// step's. Under data parallelism the checkpoint is made without a collective (StepStart::local):
// the peers may be blocked in a collective this rank will never join, or gone; the trainer then
// tells them the original error (strategy abort) and every rank ends within trainer.dist_timeout.
// A save that fails prints one line and never replaces the original error.
#include <algorithm>
#include <cctype>
#include <filesystem>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/callback.h"
#include "strobe/core/module.h"
#include "strobe/core/trainer_view.h"

namespace strobe {
namespace {

class OnExceptionCheckpoint : public Callback {
 public:
  explicit OnExceptionCheckpoint(std::string filename) : filename_(std::move(filename)) {}
  std::string name() const override { return "on_exception_checkpoint"; }

  // A writer killed mid-save (kill -9) left its temporary beside the file; whatever checkpoints the
  // run otherwise keeps (none, or in another dirpath), the next start removes it.
  void on_fit_start(TrainerView& t, Module&) override {
    if (!t.run_dir().empty())
      checkpoint::remove_stale_temp_files((std::filesystem::path(t.run_dir()) / "checkpoints").string(), filename_ + ".ckpt");
  }

  void on_train_batch_start(TrainerView& t, Module& module, const Batch&, int64_t) override {
    if (t.accumulated_batches() != 0 && in_step_) return;  // a later micro-batch of the same step
    in_step_ = true;
    record(t, module);
  }
  // After the step's update (StepPipeline::step): the weights and optimizer hold it; the loop counters
  // follow before anything else can throw.
  void on_before_zero_grad(TrainerView&, Module&, torch::optim::Optimizer&) override { in_step_ = false; }

  void on_exception(TrainerView& t, Module& module, const std::exception&) override {
    if (!start_) return;  // no training batch yet: a refusal or setup error, nothing trained to keep
    if (t.run_dir().empty()) {
      fmt::print(stderr, "strobe: on_exception_checkpoint: no run directory: nothing saved\n");
      return;
    }
    const std::string path = (std::filesystem::path(t.run_dir()) / "checkpoints" / (filename_ + ".ckpt")).string();
    try {
      if (!in_step_) record(t, module);  // between steps the live state is the last completed step's
      const auto data = t.step_access().make_checkpoint_at(*start_);
      std::filesystem::create_directories(std::filesystem::path(path).parent_path());
      checkpoint::save_checkpoint_file(path, data);
      const int64_t step = start_->loop.global_step;
      fmt::print(stderr, "strobe: training stopped by an error{}; saved {} at step {} ({}); resume with --ckpt {}\n",
                 in_step_ ? fmt::format(" in step {}", step + 1) : "", path, step,
                 in_step_ ? "the failed step's start" : "the last completed step", path);
    } catch (const std::exception& e) {
      fmt::print(stderr, "strobe: on_exception_checkpoint: could not save {}: {}\n", path, e.what());
    }
    std::fflush(stderr);
  }

 private:
  // This moment as a checkpoint records it besides the live weights and optimizer: the loop counters,
  // the generators and the buffers (copied into tensors kept from step to step by one multi-tensor
  // copy on the device, no sync). Made without a collective (StepStart::local).
  void record(TrainerView& t, Module& module) {
    torch::NoGradGuard ng;
    if (!start_) {
      start_.emplace();
      start_->local = true;
      for (const auto& b : module.net().named_buffers()) {
        live_.push_back(b.value());
        copies_.push_back(torch::empty_like(b.value()));
        start_->buffers[b.key()] = copies_.back();
      }
    }
    if (!live_.empty()) at::_foreach_copy_(copies_, live_);
    start_->loop = t.state();
    start_->rng = snapshot_rng(torch::cuda::is_available());
  }

  std::string filename_;
  bool in_step_ = false;
  std::optional<StepStart> start_;  // the latest recorded moment (the current step's start)
  std::vector<torch::Tensor> live_, copies_;  // the model's buffers and their copies in start_
};

std::shared_ptr<Callback> make_on_exception_checkpoint(config::Section& cfg) {
  const std::string filename = cfg.get_string("filename", "on_exception");
  const bool blank_edge = !filename.empty() && (std::isspace(static_cast<unsigned char>(filename.front())) ||
                                                std::isspace(static_cast<unsigned char>(filename.back())));
  const bool control = std::any_of(filename.begin(), filename.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; });
  if (filename.empty() || blank_edge || control || filename.find('/') != std::string::npos || filename.front() == '.' ||
      (filename.size() >= 5 && filename.compare(filename.size() - 5, 5, ".ckpt") == 0))
    cfg.fail("filename", fmt::format("expected a file name without '/', a leading '.', blanks at either end or the "
                                     "'.ckpt' suffix (the checkpoint is <run>/checkpoints/<filename>.ckpt), got '{}'",
                                     filename));
  // The recovery state never replaces the run's own checkpoints: last.ckpt, and model_checkpoint's
  // top-k files (step=<n>..., epoch=<e>-step=<n>...).
  if (filename == "last" || filename.rfind("step=", 0) == 0 || filename.rfind("epoch=", 0) == 0)
    cfg.fail("filename", fmt::format("'{}' is a name model_checkpoint gives its checkpoints (last, step=..., epoch=...); "
                                     "choose another (default: on_exception)",
                                     filename));
  cfg.finish();
  return std::make_shared<OnExceptionCheckpoint>(filename);
}

STROBE_REGISTER(callback_registry(), "on_exception_checkpoint", make_on_exception_checkpoint);

}  // namespace
}  // namespace strobe
