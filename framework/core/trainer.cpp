#include "framework/core/trainer.h"

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>
#include <cereal/archives/portable_binary.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include "framework/checkpoint/checkpoint_io.h"
#include "framework/core/precision.h"
#include "framework/logging/log_collector.h"
#include "framework/logging/tensorboard_logger.h"

#if STROBE_HAS_OPS
#include "framework/ops/fused_optimizers.h"
#endif

namespace strobe {

template <class Archive>
void serialize(Archive& ar, TrainerState& s) {
  ar(s.epoch, s.global_step, s.batch_in_epoch, s.batches_seen, s.val_runs, s.epoch_done, s.elapsed_s);
}

namespace {

std::atomic<int> g_signal{0};

extern "C" void on_stop_signal(int sig) {
  if (g_signal.exchange(sig) != 0) _exit(128 + sig);  // second signal: abort at once
}

torch::Device resolve_device(const std::string& spec) {
  if (spec == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  torch::Device d(spec);
  if (d.is_cuda()) {
    if (!torch::cuda::is_available())
      throw config::ConfigError(fmt::format("trainer.device: '{}' requested but no CUDA device is visible", spec));
    int64_t idx = d.has_index() ? d.index() : 0;
    if (idx >= static_cast<int64_t>(torch::cuda::device_count()))
      throw config::ConfigError(fmt::format("trainer.device: '{}' requested but only {} CUDA device(s) are visible", spec,
                                            torch::cuda::device_count()));
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(idx));
  }
  return d;
}

std::string archive_to_string(torch::serialize::OutputArchive& a) {
  std::ostringstream os;
  a.save_to(os);
  return os.str();
}

}  // namespace

Trainer::Trainer(config::Experiment experiment, std::string resolved_config_yaml, std::shared_ptr<Module> module,
                 std::shared_ptr<DataModule> datamodule, std::vector<std::shared_ptr<Callback>> callbacks, std::string run_dir)
    : exp_(std::move(experiment)),
      config_yaml_(std::move(resolved_config_yaml)),
      module_(std::move(module)),
      datamodule_(std::move(datamodule)),
      callbacks_(std::move(callbacks)),
      run_dir_(std::move(run_dir)) {
  device_ = resolve_device(exp_.trainer.device);
  if (exp_.trainer.precision == "16-mixed" && !device_.is_cuda())
    throw config::ConfigError("trainer.precision: 16-mixed needs a CUDA device (use bf16-mixed on CPU)");
  if (exp_.trainer.deterministic) {
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
  torch::manual_seed(static_cast<uint64_t>(exp_.seed));
  module_->net().to(device_);
  found_nonfinite_ = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
  collector_ = std::make_unique<logging::LogCollector>(device_);
  std::set<std::string> keys;
  for (auto& cb : callbacks_)
    if (!keys.insert(cb->state_key()).second)
      throw config::ConfigError(fmt::format("callbacks: two callbacks share the state key '{}'", cb->state_key()));
}

Trainer::~Trainer() = default;

template <class F>
void Trainer::each(F&& f) {
  for (auto& cb : callbacks_) f(*cb);
}

void Trainer::request_stop(int exit_code) {
  should_stop_ = true;
  if (exit_code != kExitOk) stop_code_ = exit_code;
}

const std::map<std::string, double>& Trainer::metrics() const { return collector_->latest(); }
void Trainer::drain_metrics() { collector_->drain(); }
void Trainer::add_metric_consumer(logging::MetricConsumer* c) { collector_->add_consumer(c); }
void Trainer::log_host(const std::vector<std::pair<std::string, double>>& values) {
  collector_->emit_host(state_.global_step, state_.epoch, values);
}

int64_t Trainer::estimated_stepping_batches() const {
  const auto& c = exp_.trainer;
  int64_t per_epoch = (num_train_batches_ + c.accumulate_grad_batches - 1) / c.accumulate_grad_batches;
  int64_t by_epochs = c.max_epochs >= 0 ? per_epoch * c.max_epochs : -1;
  if (c.max_steps >= 0) return by_epochs >= 0 ? std::min(by_epochs, c.max_steps) : c.max_steps;
  return by_epochs;
}

void Trainer::setup_common(Stage stage) {
  datamodule_->setup(stage);
  each([&](Callback& cb) { cb.setup(*this, *module_, stage); });
}

void Trainer::setup_for_fit() {
  if (fit_setup_done_) return;
  fit_setup_done_ = true;
  auto& c = exp_.trainer;
  setup_common(Stage::Fit);
  train_loader_ = datamodule_->train_loader();
  if (!train_loader_) throw std::runtime_error(fmt::format("data '{}' has no training set", exp_.data.node()["name"].Scalar()));
  train_loader_->set_pin_memory(device_.is_cuda());
  int64_t full = train_loader_->num_batches();
  int64_t n = c.limit_train_batches.resolve(full);
  if (c.overfit_batches.is_count ? c.overfit_batches.count > 0 : c.overfit_batches.fraction > 0.0) {
    n = c.overfit_batches.resolve(full);
    train_loader_->set_shuffle(false);
  }
  if (c.fast_dev_run > 0) n = std::min(full, c.fast_dev_run);
  train_loader_->set_limit_batches(n);
  num_train_batches_ = train_loader_->num_batches();
  if (num_train_batches_ == 0) throw std::runtime_error("the training set yields no batches (check data and limit_train_batches)");

  auto setup = module_->configure_optimizers();
  optimizer_ = setup.optimizer;
  scheduler_ = setup.scheduler;
  if (!optimizer_) {
    std::vector<torch::Tensor> params;
    for (auto& p : module_->net().parameters())
      if (p.requires_grad()) params.push_back(p);
    optimizer_ = build_optimizer(exp_.optimizer, params, device_, &optimizer_info_);
  }
  if (!scheduler_) scheduler_ = build_scheduler(exp_.scheduler, *optimizer_, estimated_stepping_batches());
  if (c.precision == "16-mixed") scaler_ = std::make_unique<GradScaler>(device_);
}

Batch Trainer::prepare_batch(Batch batch, int64_t idx) {
  if (datamodule_->injected_batch() && module_->stage() == Stage::Fit && module_->training()) batch = *datamodule_->injected_batch();
  batch = datamodule_->on_before_batch_transfer(std::move(batch), idx);
  batch = datamodule_->transfer_batch_to_device(batch, device_, idx);
  return datamodule_->on_after_batch_transfer(std::move(batch), idx);
}

void Trainer::clip_gradients(const std::vector<torch::Tensor>& grads) {
  const auto& c = exp_.trainer;
  if (c.gradient_clip_val <= 0 || grads.empty()) return;
  torch::NoGradGuard ng;
  if (c.gradient_clip_algorithm == "value") {
    for (auto& g : grads) g.clamp_(-c.gradient_clip_val, c.gradient_clip_val);
    return;
  }
  // Norm clipping without a host read: the coefficient stays on the device.
  auto norms = at::_foreach_norm(grads, 2);
  auto total = torch::linalg_vector_norm(torch::stack(norms), 2, c10::nullopt, false, torch::kFloat32);
  auto coef = (c.gradient_clip_val / (total + 1e-6)).clamp_max(1.0);
  at::_foreach_mul_(grads, coef);
}

void Trainer::optimizer_step() {
  std::vector<torch::Tensor> grads;
  for (auto& p : module_->net().parameters())
    if (p.grad().defined()) grads.push_back(p.grad());
  if (scaler_) scaler_->unscale(grads);
  clip_gradients(grads);
  each([&](Callback& cb) { cb.on_before_optimizer_step(*this, *module_, *optimizer_); });
  bool fused = false;
#if STROBE_HAS_OPS
  if (auto* f = dynamic_cast<ops::FusedOptimizerBase*>(optimizer_.get())) {
    fused = true;
    torch::Tensor flag = found_nonfinite_;
    if (scaler_) flag = flag + scaler_->found_inf();  // both 0/1 floats: non-zero = skip
    f->set_found_nonfinite(flag);
    optimizer_->step();
  }
#endif
  if (!fused) {
    // torch::optim cannot skip on the device: with loss scaling this is the one host read per step,
    // as in PyTorch's GradScaler.
    if (!scaler_ || scaler_->found_inf().item<float>() == 0.0f) optimizer_->step();
  }
  if (scaler_) scaler_->update();
  each([&](Callback& cb) { cb.on_before_zero_grad(*this, *module_, *optimizer_); });
  optimizer_->zero_grad(true);
  accum_count_ = 0;
  ++state_.global_step;
  if (scheduler_) scheduler_->step(state_.global_step);
  bool emit = state_.global_step % exp_.trainer.log_every_n_steps == 0 || state_.global_step == 1;
  collector_->end_step(state_.global_step, state_.epoch, emit);
}

torch::Tensor Trainer::run_training_batch(Batch host_batch, int64_t batch_idx) {
  setup_for_fit();
  module_->attach(collector_.get(), Stage::Fit, true);
  collector_->set_training(true);
  each([&](Callback& cb) { cb.on_train_batch_start(*this, *module_, host_batch, batch_idx); });
  Batch batch = prepare_batch(std::move(host_batch), 0);
  module_->set_current_batch_size(batch.batch_size());
  torch::Tensor loss;
  {
    AutocastGuard ac(device_, exp_.trainer.precision);
    loss = module_->training_step(batch, batch_idx);
  }
  const int64_t accumulate = exp_.trainer.accumulate_grad_batches;
  if (loss.defined()) {
    auto to_backward = accumulate > 1 ? loss / static_cast<double>(accumulate) : loss;
    if (scaler_) to_backward = scaler_->scale(to_backward);
    each([&](Callback& cb) { cb.on_before_backward(*this, *module_, loss); });
    to_backward.backward();
    each([&](Callback& cb) { cb.on_after_backward(*this, *module_); });
  }
  ++accum_count_;
  bool last_of_epoch = batch_idx + 1 >= num_train_batches_;
  if (accum_count_ >= accumulate || last_of_epoch) optimizer_step();
  return loss.defined() ? loss.detach() : loss;
}

bool Trainer::should_validate_now(int64_t batch_in_epoch, bool epoch_end) const {
  const auto& c = exp_.trainer;
  auto loader = datamodule_->val_loader();
  if (!loader || c.fast_dev_run < 0) return false;
  if (c.limit_val_batches.resolve(loader->num_batches()) == 0) return false;
  if (c.val_check_interval.is_count) return batch_in_epoch % c.val_check_interval.count == 0;
  if ((state_.epoch + 1) % c.check_val_every_n_epoch != 0) return false;
  int64_t every = std::max<int64_t>(1, static_cast<int64_t>(c.val_check_interval.fraction * num_train_batches_));
  if (c.val_check_interval.fraction >= 1.0) return epoch_end;
  return batch_in_epoch % every == 0 || epoch_end;
}

bool Trainer::done() const {
  const auto& c = exp_.trainer;
  if (should_stop_ || g_signal.load() != 0) return true;
  if (c.max_steps >= 0 && state_.global_step >= c.max_steps) return true;
  if (c.fast_dev_run > 0 && state_.epoch_done) return true;
  if (c.max_epochs >= 0 && state_.epoch_done && state_.epoch + 1 >= c.max_epochs) return true;
  if (c.max_time_s) {
    double elapsed = state_.elapsed_s + std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count();
    if (elapsed >= *c.max_time_s) return true;
  }
  return false;
}

void Trainer::train_epoch() {
  const bool fresh_epoch = state_.batch_in_epoch == 0;
  train_loader_->start(state_.epoch, state_.batch_in_epoch);
  module_->net().train();
  if (fresh_epoch) {
    module_->on_train_epoch_start();
    each([&](Callback& cb) { cb.on_train_epoch_start(*this, *module_); });
  }
  while (auto b = train_loader_->next()) {
    const int64_t idx = state_.batch_in_epoch;
    const Batch host_batch = *b;  // tensor handles only: the hooks after the step see the batch
    torch::Tensor loss = run_training_batch(std::move(*b), idx);
    ++state_.batch_in_epoch;
    ++state_.batches_seen;
    const bool last = state_.batch_in_epoch >= num_train_batches_;
    if (last) state_.epoch_done = true;
    each([&](Callback& cb) { cb.on_train_batch_end(*this, *module_, loss, host_batch, idx); });
    if (should_validate_now(state_.batch_in_epoch, last)) {
      run_eval(Stage::Validate, -1, false);
      module_->net().train();
    }
    if (last) break;
    if (accum_count_ == 0 && done()) break;
  }
  train_loader_->stop();
  if (state_.epoch_done) {
    module_->on_train_epoch_end();
    collector_->set_training(true);
    collector_->end_epoch(state_.global_step, state_.epoch, false);
    each([&](Callback& cb) { cb.on_train_epoch_end(*this, *module_); });
  }
}

void Trainer::run_eval(Stage stage, int64_t limit, bool sanity) {
  auto loader = stage == Stage::Validate ? datamodule_->val_loader() : datamodule_->test_loader();
  if (!loader) return;
  loader->set_pin_memory(device_.is_cuda());
  const auto& c = exp_.trainer;
  loader->set_limit_batches(-1);
  int64_t n = (stage == Stage::Validate ? c.limit_val_batches : c.limit_test_batches).resolve(loader->num_batches());
  if (c.fast_dev_run > 0) n = std::min(n, c.fast_dev_run);
  if (limit >= 0) n = std::min(n, limit);
  if (n == 0) return;
  const bool was_training = module_->net().is_training();
  module_->net().eval();
  collector_->set_training(false);
  module_->attach(collector_.get(), stage, false);
  torch::NoGradGuard no_grad;
  const bool val = stage == Stage::Validate;
  if (val) {
    each([&](Callback& cb) { cb.on_validation_start(*this, *module_); });
    module_->on_validation_epoch_start();
    each([&](Callback& cb) { cb.on_validation_epoch_start(*this, *module_); });
  } else {
    each([&](Callback& cb) { cb.on_test_start(*this, *module_); });
    each([&](Callback& cb) { cb.on_test_epoch_start(*this, *module_); });
  }
  loader->start(0, 0);
  for (int64_t i = 0; i < n; ++i) {
    auto b = loader->next();
    if (!b) break;
    if (val)
      each([&](Callback& cb) { cb.on_validation_batch_start(*this, *module_, *b, i); });
    else
      each([&](Callback& cb) { cb.on_test_batch_start(*this, *module_, *b, i); });
    Batch batch = prepare_batch(std::move(*b), 0);
    module_->set_current_batch_size(batch.batch_size());
    {
      AutocastGuard ac(device_, c.precision);
      if (val)
        module_->validation_step(batch, i);
      else
        module_->test_step(batch, i);
    }
    if (val)
      each([&](Callback& cb) { cb.on_validation_batch_end(*this, *module_, batch, i); });
    else
      each([&](Callback& cb) { cb.on_test_batch_end(*this, *module_, batch, i); });
  }
  loader->stop();
  if (val) {
    module_->on_validation_epoch_end();
  } else {
    module_->on_test_epoch_end();
  }
  if (sanity) {
    collector_->discard_epoch();
  } else {
    collector_->end_epoch(state_.global_step, state_.epoch, /*wait=*/true);
  }
  if (val) {
    if (!sanity) ++state_.val_runs;
    each([&](Callback& cb) { cb.on_validation_epoch_end(*this, *module_); });
    if (!sanity && scheduler_ && scheduler_->wants_monitor()) {
      auto it = metrics().find(scheduler_->monitor());
      if (it == metrics().end())
        throw std::runtime_error(fmt::format("scheduler.monitor: '{}' was not logged during validation", scheduler_->monitor()));
      scheduler_->on_validation_end(it->second);
    }
    each([&](Callback& cb) { cb.on_validation_end(*this, *module_); });
  } else {
    each([&](Callback& cb) { cb.on_test_epoch_end(*this, *module_); });
    each([&](Callback& cb) { cb.on_test_end(*this, *module_); });
  }
  collector_->set_training(true);
  module_->attach(collector_.get(), Stage::Fit, true);
  if (was_training) module_->net().train();
}

void Trainer::install_signal_handlers() {
  g_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int Trainer::fit(const std::optional<std::string>& ckpt_path) {
  setup_for_fit();
  const auto& c = exp_.trainer;
  if (ckpt_path) load_checkpoint(*ckpt_path, true);
  if (!run_dir_.empty() && c.fast_dev_run == 0 && exp_.logger.csv) {
    // On resume, the rows logged up to the checkpoint are kept and anything a crashed continuation
    // wrote after it is dropped.
    csv_ = std::make_unique<logging::CsvLogger>(run_dir_ + "/metrics.csv", ckpt_path ? state_.global_step : -1);
    collector_->add_consumer(csv_.get());
  }
  if (!run_dir_.empty() && c.fast_dev_run == 0 && exp_.logger.tensorboard) {
    tensorboard_ = std::make_unique<logging::TensorBoardLogger>(run_dir_, config_yaml_);
    collector_->add_consumer(tensorboard_.get());
  }
  install_signal_handlers();
  start_time_ = std::chrono::steady_clock::now();
  try {
    each([&](Callback& cb) { cb.on_fit_start(*this, *module_); });
    if (!ckpt_path && c.fast_dev_run == 0 && c.num_sanity_val_steps != 0 && datamodule_->val_loader()) {
      sanity_checking_ = true;
      each([&](Callback& cb) { cb.on_sanity_check_start(*this, *module_); });
      run_eval(Stage::Validate, c.num_sanity_val_steps < 0 ? -1 : c.num_sanity_val_steps, true);
      each([&](Callback& cb) { cb.on_sanity_check_end(*this, *module_); });
      sanity_checking_ = false;
    }
    each([&](Callback& cb) { cb.on_train_start(*this, *module_); });
    while (!done()) {
      if (state_.epoch_done) {
        ++state_.epoch;
        state_.batch_in_epoch = 0;
        state_.epoch_done = false;
      }
      train_epoch();
    }
    collector_->drain();
    int sig = g_signal.load();
    if (sig != 0) {
      stop_code_ = 128 + sig;
      if (!run_dir_.empty()) {
        save_checkpoint(run_dir_ + "/checkpoints/last.ckpt");
        fmt::print(stderr, "\nstrobe: {} received; saved {}/checkpoints/last.ckpt at step {}\n",
                   sig == SIGINT ? "SIGINT" : "SIGTERM", run_dir_, state_.global_step);
      }
    }
    each([&](Callback& cb) { cb.on_train_end(*this, *module_); });
    collector_->drain();
    each([&](Callback& cb) { cb.on_fit_end(*this, *module_); });
    each([&](Callback& cb) { cb.teardown(*this, *module_, Stage::Fit); });
  } catch (const std::exception& e) {
    each([&](Callback& cb) { cb.on_exception(*this, *module_, e); });
    throw;
  }
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  return stop_code_;
}

int Trainer::validate(const std::optional<std::string>& ckpt_path) {
  setup_common(Stage::Validate);
  if (ckpt_path) load_checkpoint(*ckpt_path, false);
  run_eval(Stage::Validate, -1, false);
  each([&](Callback& cb) { cb.teardown(*this, *module_, Stage::Validate); });
  return kExitOk;
}

int Trainer::test(const std::optional<std::string>& ckpt_path) {
  setup_common(Stage::Test);
  if (ckpt_path) load_checkpoint(*ckpt_path, false);
  run_eval(Stage::Test, -1, false);
  each([&](Callback& cb) { cb.teardown(*this, *module_, Stage::Test); });
  return kExitOk;
}

std::vector<torch::Tensor> Trainer::predict(const std::optional<std::string>& ckpt_path) {
  setup_common(Stage::Predict);
  if (ckpt_path) load_checkpoint(*ckpt_path, false);
  auto loader = datamodule_->predict_loader();
  std::vector<torch::Tensor> out;
  if (!loader) return out;
  loader->set_limit_batches(-1);
  int64_t n = exp_.trainer.limit_predict_batches.resolve(loader->num_batches());
  module_->net().eval();
  module_->attach(collector_.get(), Stage::Predict, false);
  torch::NoGradGuard ng;
  each([&](Callback& cb) { cb.on_predict_start(*this, *module_); });
  each([&](Callback& cb) { cb.on_predict_epoch_start(*this, *module_); });
  loader->start(0, 0);
  for (int64_t i = 0; i < n; ++i) {
    auto b = loader->next();
    if (!b) break;
    each([&](Callback& cb) { cb.on_predict_batch_start(*this, *module_, *b, i); });
    Batch batch = prepare_batch(std::move(*b), 0);
    torch::Tensor y;
    {
      AutocastGuard ac(device_, exp_.trainer.precision);
      y = module_->predict_step(batch, i);
    }
    each([&](Callback& cb) { cb.on_predict_batch_end(*this, *module_, y, batch, i); });
    out.push_back(y);
  }
  loader->stop();
  each([&](Callback& cb) { cb.on_predict_epoch_end(*this, *module_); });
  each([&](Callback& cb) { cb.on_predict_end(*this, *module_); });
  return out;
}

checkpoint::CheckpointData Trainer::make_checkpoint() {
  checkpoint::CheckpointData d;
  for (const auto& p : module_->net().named_parameters()) d.tensors["model/" + p.key()] = p.value().detach();
  for (const auto& b : module_->net().named_buffers()) d.tensors["model/" + b.key()] = b.value();
  if (optimizer_) {
    torch::serialize::OutputArchive a;
    optimizer_->save(a);
    d.blobs["optimizer"] = archive_to_string(a);
  }
  if (scheduler_) d.blobs["scheduler"] = scheduler_->state_dict().dump();
  if (scaler_) {
    d.tensors["scaler/scale"] = scaler_->scale_tensor();
    d.tensors["scaler/growth_tracker"] = scaler_->growth_tracker();
  }
  {
    TrainerState s = state_;
    if (start_time_.time_since_epoch().count() != 0)
      s.elapsed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count();
    std::ostringstream os;
    {
      cereal::PortableBinaryOutputArchive ar(os);
      ar(s);
    }
    d.blobs["loop"] = os.str();
  }
  {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    d.tensors["rng/cpu"] = cpu.get_state();
  }
  if (torch::cuda::is_available()) {
    for (size_t i = 0; i < torch::cuda::device_count(); ++i) {
      at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      d.tensors[fmt::format("rng/cuda/{}", i)] = gen.get_state();
    }
  }
  nlohmann::json cbs = nlohmann::json::object();
  for (auto& cb : callbacks_) cbs[cb->state_key()] = cb->state_dict();
  d.blobs["callbacks"] = cbs.dump();
  d.blobs["config"] = config_yaml_;
  nlohmann::json meta = {{"format_version", checkpoint::kFormatVersion},
                         {"strobe_version", STROBE_VERSION},
                         {"device", device_.str()},
                         {"precision", exp_.trainer.precision},
                         {"global_step", state_.global_step},
                         {"epoch", state_.epoch}};
  d.blobs["meta"] = meta.dump();
  each([&](Callback& cb) { cb.on_save_checkpoint(*this, *module_, d); });
  return d;
}

void Trainer::save_checkpoint(const std::string& path) {
  checkpoint::save_checkpoint_file(path, make_checkpoint());
}

void Trainer::restore_rng(const checkpoint::CheckpointData& d) {
  {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(d.tensor("rng/cpu"));
  }
  if (torch::cuda::is_available()) {
    for (size_t i = 0; i < torch::cuda::device_count(); ++i) {
      auto it = d.tensors.find(fmt::format("rng/cuda/{}", i));
      if (it == d.tensors.end()) continue;
      at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(it->second);
    }
  }
}

void Trainer::load_checkpoint(const std::string& path, bool restore_training_state) {
  checkpoint::CheckpointData d = checkpoint::load_checkpoint_file(path);
  try {
    torch::NoGradGuard ng;
    auto load_into = [&](const std::string& key, torch::Tensor target) {
      auto it = d.tensors.find("model/" + key);
      if (it == d.tensors.end())
        throw checkpoint::CheckpointError(fmt::format("{}: has no weights for '{}' (a checkpoint of a different model?)", path, key));
      if (it->second.sizes() != target.sizes())
        throw checkpoint::CheckpointError(fmt::format("{}: '{}' has shape {} in the checkpoint but {} in the model", path, key,
                                                      c10::str(it->second.sizes()), c10::str(target.sizes())));
      target.copy_(it->second);
    };
    for (auto& p : module_->net().named_parameters()) load_into(p.key(), p.value());
    for (auto& b : module_->net().named_buffers()) load_into(b.key(), b.value());
    if (!restore_training_state) {
      std::istringstream is(d.blob("loop"));
      cereal::PortableBinaryInputArchive ar(is);
      ar(state_);
      return;
    }
    if (optimizer_ && d.has_blob("optimizer")) {
      torch::serialize::InputArchive a;
      std::istringstream is(d.blob("optimizer"));
      a.load_from(is, device_);
      optimizer_->load(a);
    }
    if (scheduler_ && d.has_blob("scheduler")) scheduler_->load_state_dict(nlohmann::json::parse(d.blob("scheduler")));
    if (scaler_ && d.tensors.count("scaler/scale")) scaler_->load(d.tensor("scaler/scale"), d.tensor("scaler/growth_tracker"));
    {
      std::istringstream is(d.blob("loop"));
      cereal::PortableBinaryInputArchive ar(is);
      ar(state_);
    }
    auto cbs = nlohmann::json::parse(d.blob("callbacks"));
    for (auto& cb : callbacks_)
      if (cbs.contains(cb->state_key())) cb->load_state_dict(cbs.at(cb->state_key()));
    restore_rng(d);
    each([&](Callback& cb) { cb.on_load_checkpoint(*this, *module_, d); });
  } catch (const checkpoint::CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw checkpoint::CheckpointError(fmt::format("{}: cannot restore: {}", path, e.what()));
  }
}

}  // namespace strobe
