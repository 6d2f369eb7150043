#include "runner/step_memory.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/engine_access.h"
#include "strobe/core/datamodule.h"
#include "strobe/core/memory_budget.h"
#include "strobe/core/module.h"
#include "strobe/core/precision.h"
#include "strobe/core/throughput.h"
#include "strobe/data/loader.h"

namespace strobe {
namespace {

// Wraps the CPU allocator: every allocation goes through the wrapped one, and the bytes alive and
// their peak are counted. Its data pointers are simple (the context is the data, as raw_allocate
// requires): the wrapped block and its size are kept by address until the deleter runs.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return base_->allocate(0);
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_[data] = Block{std::move(inner), n};
      live_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, live_);
    }
    return {data, data, &CountingAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { base_->copy_data(dest, src, count); }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = live_;
  }
  int64_t live() {
    std::lock_guard<std::mutex> lock(mu_);
    return live_;
  }
  int64_t peak() {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t n = 0;
  };
  static void release(void* p);
  c10::Allocator* base_;
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
  int64_t live_ = 0, peak_ = 0;
};

// One process-wide wrapper (a deleter may run long after the trial); installed only during a trial.
CountingAllocator& counting_allocator() {
  static CountingAllocator* a = new CountingAllocator(c10::GetCPUAllocator());
  return *a;
}

void CountingAllocator::release(void* p) {
  CountingAllocator& a = counting_allocator();
  c10::DataPtr inner;
  {
    std::lock_guard<std::mutex> lock(a.mu_);
    auto it = a.blocks_.find(p);
    if (it == a.blocks_.end()) return;
    a.live_ -= static_cast<int64_t>(it->second.n);
    inner = std::move(it->second.inner);
    a.blocks_.erase(it);
  }
  // `inner` frees the wrapped block here, outside the lock.
}

// The trial's batch of `count` samples on `device`, through the data module's hooks.
Batch trial_batch(DataModule& dm, data::DataLoader& loader, int64_t count, const torch::Device& device) {
  Batch batch = dm.on_before_batch_transfer(loader.make_first_samples(0, count), 0);
  return dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, device, 0), 0);
}

// The forward and the backward of `batch` (on the module's device); the caller reads its peak, then
// releases the gradients.
void forward_backward(Module& module, const Batch& batch, Precision precision, const torch::Device& device) {
  AutocastGuard autocast(device, precision);
  EngineAccess::set_current_batch_size(module, batch.batch_size());
  module.training_step(batch, 0).backward();
}

void release_grads(Module& module) {
  for (auto& p : module.net().parameters()) p.mutable_grad() = torch::Tensor();
}

// The peak bytes of one training step on `count` samples above what was alive before it. On CUDA the
// caching allocator's own peak, the batch on the device included; on the CPU the counting allocator's
// (the host batch is the loader's, checked on its own).
double step_peak(Module& module, DataModule& dm, data::DataLoader& loader, int64_t count, Precision precision,
                 const torch::Device& device) {
  if (device.is_cuda()) {
    const double base = device_memory(device)->allocated;
    reset_device_peak(device);
    forward_backward(module, trial_batch(dm, loader, count, device), precision, device);
    const double peak = device_memory(device)->peak_allocated;
    release_grads(module);
    return peak - base;
  }
  const Batch batch = trial_batch(dm, loader, count, device);
  CountingAllocator& counter = counting_allocator();
  c10::Allocator* before = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&counter, /*priority=*/0);
  if (c10::GetCPUAllocator() != &counter) return -1;  // another allocator holds a higher priority
  struct Restore {
    c10::Allocator* to;
    ~Restore() { c10::SetCPUAllocator(to, 0); }
  } restore{before};
  counter.reset_peak();
  const int64_t base = counter.live();
  forward_backward(module, batch, precision, device);
  release_grads(module);
  return static_cast<double>(counter.peak() - base);
}

}  // namespace

std::optional<StepMemory> measure_step_memory(const config::Experiment& exp, DataModule& dm, Module& module,
                                              const torch::Device& device, int64_t world_size) {
  if (!exp.trainer.memory_check || !(device.is_cpu() || device.is_cuda()) || world_size > 1 ||
      exp.trainer.precision == Precision::kBf16Master)
    return std::nullopt;
  auto loader = dm.train_loader();
  if (!loader || loader->dataset().size() < 4) return std::nullopt;
  StepMemory m;
  if (device.is_cuda()) {
    release_cached_device_memory(device);
    m.available = device_free_bytes(device).value_or(0);
    m.where = fmt::format("{} memory is free", device.str());
  } else {
    m.available = static_cast<double>(available_memory_bytes());
    m.where = "memory is available";
  }
  m.batch = std::min<int64_t>(loader->options().batch_size, loader->dataset().size());
  // What the trial changes, restored after it: buffers (BatchNorm's statistics), gradients, the
  // generator (dropout draws), the train/eval mode.
  auto& net = module.net();
  std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers;
  for (auto& b : net.buffers())
    if (b.defined()) buffers.emplace_back(b, b.clone());
  std::vector<std::pair<torch::Tensor, torch::Tensor>> grads;
  for (auto& p : net.parameters()) grads.emplace_back(p, p.grad().defined() ? p.grad().clone() : torch::Tensor());
  const torch::Tensor rng = at::detail::getDefaultCPUGenerator().get_state().clone();
  const bool was_training = net.is_training();
  double two = -1, four = -1;
  try {
    // On CUDA the model moves to the device for the trial and stays there: the trainer moves it
    // there next (its move is then a no-op), so the trial costs no transfer back.
    if (device.is_cuda()) net.to(device);
    net.train();
    // On CUDA the first step allocates what then stays (cuBLAS's workspace, cuDNN's): a step first
    // that is not measured, so that the two measured ones differ by their samples alone.
    if (device.is_cuda()) step_peak(module, dm, *loader, 2, exp.trainer.precision, device);
    two = step_peak(module, dm, *loader, 2, exp.trainer.precision, device);
    four = two < 0 ? -1 : step_peak(module, dm, *loader, 4, exp.trainer.precision, device);
  } catch (const std::exception&) {
    two = four = -1;  // the run meets the problem itself, with its own message
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& [live, saved] : buffers) live.copy_(saved);
  }
  for (auto& [p, g] : grads) p.mutable_grad() = g.defined() ? g.to(p.device()) : g;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  }
  net.train(was_training);
  release_cached_device_memory(device);  // the trial's blocks go back; the run starts from an empty cache
  if (two < 0 || four < 0) return std::nullopt;
  m.per_sample = std::max(0.0, (four - two) / 2.0);
  m.fixed = std::max(0.0, two - 2.0 * m.per_sample);
  // Two optimizer moments per trainable parameter; on CUDA the parameters and buffers live on the
  // device too (on the CPU they are already allocated, outside the memory available).
  auto bytes = [](const torch::Tensor& t) { return static_cast<double>(t.numel()) * static_cast<double>(t.element_size()); };
  const bool resident = device.is_cuda();
  for (const auto& p : net.parameters()) {
    if (p.requires_grad()) m.optimizer += 2.0 * bytes(p);
    if (resident) m.resident += bytes(p);
  }
  if (resident)
    for (const auto& b : net.buffers())
      if (b.defined()) m.resident += bytes(b);
  return m;
}

void check_step_memory(config::Section& data_cfg, const StepMemory& m) {
  if (m.total() <= m.available) return;
  const std::string weights = m.resident > 0 ? fmt::format(", {} of parameters and buffers", human_bytes(m.resident)) : "";
  data_cfg.fail("batch_size",
                fmt::format("a training step on {} samples needs about {} (measured by a forward and backward on 2 and 4 "
                            "samples: {} a sample, {} at any size{}, and {} of optimizer state), but only {} of {}; lower "
                            "data.batch_size (trainer.accumulate_grad_batches keeps the effective batch; "
                            "trainer.memory_check: false skips this check)",
                            m.batch, human_bytes(m.total()), human_bytes(m.per_sample), human_bytes(m.fixed), weights,
                            human_bytes(m.optimizer), human_bytes(m.available), m.where));
}

}  // namespace strobe
