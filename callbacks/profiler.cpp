#include "callbacks/profiler.h"

#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include "strobe/config/config.h"
#include "strobe/core/trainer_view.h"

namespace strobe {
namespace {

namespace fs = std::filesystem;
namespace kp = torch::autograd::profiler;
namespace pi = torch::profiler::impl;

class Profiler : public Callback {
 public:
  Profiler(config::ProfilerConfig cfg, std::string dir) : cfg_(std::move(cfg)), dir_(std::move(dir)) {}
  std::string name() const override { return "profiler"; }
  std::string state_key() const override { return "profiler"; }

  void on_fit_start(TrainerView&, Module&) override {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec || !fs::is_directory(dir_, ec))
      throw config::ConfigError(
          fmt::format("trainer.profiler.path: cannot create the trace directory '{}' ({})", dir_, ec.message()));
  }

  void on_train_batch_start(TrainerView& t, Module&, const Batch&, int64_t) override {
    if (t.accumulated_batches() != 0 || done_) return;  // inside a step's accumulation window
    const int64_t step = t.state().global_step + 1;     // the step this batch starts
    if (step < cfg_.first_step || step > cfg_.last_step) return;
    if (!active_) start(t);
    // Step N's range runs to the start of step N+1 (as torch.profiler's step() marks them): what the
    // loop does between two steps (the loader's next batch, a validation run) belongs to step N.
    step_range_.reset();
    step_range_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (step_range_->isActive()) step_range_->before(fmt::format("ProfilerStep#{}", step));
    ++steps_;
  }

  void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    if (!active_ || t.accumulated_batches() != 0) return;  // the optimizer step has not run yet
    if (t.state().global_step >= cfg_.last_step) finish(t, "");
  }

  void on_train_end(TrainerView& t, Module&) override {
    if (active_) {
      finish(t, fmt::format("training ended at step {}, before step {}", t.state().global_step, cfg_.last_step));
    } else if (!done_) {
      fmt::print(stderr, "strobe: trainer.profiler: training ended at step {}, before step {}: no trace written\n",
                 t.state().global_step, cfg_.first_step);
    }
  }

  void on_exception(TrainerView&, Module&, const std::exception&) override {
    if (!active_) return;
    step_range_.reset();
    kp::disableProfiler();  // the run is failing: drop the partial trace
    active_ = false;
  }

 private:
  void start(TrainerView& t) {
    std::set<pi::ActivityType> activities{pi::ActivityType::CPU};
    if (t.device().is_cuda()) {
      activities.insert(pi::ActivityType::CUDA);
    } else {
      // A CUDA build of libtorch on a machine without a GPU: Kineto logs "gpuGetDeviceCount failed"
      // as an ERROR although only CPU ops are asked for. Its log level is read when it initialises.
      ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
    }
    const pi::ProfilerConfig pc(pi::ProfilerState::KINETO, cfg_.record_shapes, /*profile_memory=*/false,
                                /*with_stack=*/false, /*with_flops=*/false, /*with_modules=*/false);
    kp::prepareProfiler(pc, activities);
    kp::enableProfiler(pc, activities);
    active_ = true;
  }

  void finish(TrainerView& t, const std::string& early) {
    step_range_.reset();
    if (t.device().is_cuda()) torch::cuda::synchronize();  // the last step's kernels, in the trace
    auto result = kp::disableProfiler();
    active_ = false;
    done_ = true;
    char host[256] = "localhost";
    ::gethostname(host, sizeof(host) - 1);
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
    const std::string name = fmt::format("{}_{}.{}.pt.trace.json", host, ::getpid(), ms);
    const std::string path = (fs::path(dir_) / name).string();
    const std::string tmp = (fs::path(dir_) / fmt::format(".{}.tmp.{}", name, ::getpid())).string();
    result->save(tmp);
    std::error_code ec;
    fs::rename(tmp, path, ec);
    if (ec) throw std::runtime_error(fmt::format("trainer.profiler: cannot write {} ({})", path, ec.message()));
    if (!early.empty())
      fmt::print(stderr, "strobe: trainer.profiler: {}: the trace holds {} step(s): {}\n", early, steps_, path);
    else
      fmt::print(stderr, "strobe: profiler trace of steps {}-{}: {}\n", cfg_.first_step, cfg_.last_step, path);
  }

  config::ProfilerConfig cfg_;
  std::string dir_;
  bool active_ = false, done_ = false;
  int64_t steps_ = 0;
  std::unique_ptr<at::RecordFunction> step_range_;
};

}  // namespace

std::shared_ptr<Callback> make_profiler_callback(const config::ProfilerConfig& cfg, const std::string& dir) {
  return std::make_shared<Profiler>(cfg, dir);
}

}  // namespace strobe
