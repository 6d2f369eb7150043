#include "runner/step_memory.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/core/datamodule.h"
#include "strobe/core/memory_budget.h"
#include "strobe/core/module.h"
#include "strobe/core/precision.h"
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

// The peak bytes of one training step on `count` samples above what was alive before it.
double step_peak(Module& module, DataModule& dm, data::DataLoader& loader, int64_t count, Precision precision) {
  Batch batch = loader.make_first_samples(0, count);
  batch = dm.on_before_batch_transfer(std::move(batch), 0);
  batch = dm.transfer_batch_to_device(batch, torch::Device(torch::kCPU), 0);
  batch = dm.on_after_batch_transfer(std::move(batch), 0);
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
  {
    AutocastGuard autocast(torch::Device(torch::kCPU), precision);
    module.set_current_batch_size(batch.batch_size());
    torch::Tensor loss = module.training_step(batch, 0);
    loss.backward();
  }
  for (auto& p : module.net().parameters()) p.mutable_grad() = torch::Tensor();
  return static_cast<double>(counter.peak() - base);
}

}  // namespace

std::optional<StepMemory> measure_step_memory(const config::Experiment& exp, DataModule& dm, Module& module,
                                              const torch::Device& device, int64_t world_size) {
  if (!device.is_cpu() || world_size > 1 || exp.trainer.precision == Precision::kBf16Master) return std::nullopt;
  auto loader = dm.train_loader();
  if (!loader || loader->dataset().size() < 4) return std::nullopt;
  StepMemory m;
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
    net.train();
    two = step_peak(module, dm, *loader, 2, exp.trainer.precision);
    four = two < 0 ? -1 : step_peak(module, dm, *loader, 4, exp.trainer.precision);
  } catch (const std::exception&) {
    two = four = -1;  // the run meets the problem itself, with its own message
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& [live, saved] : buffers) live.copy_(saved);
  }
  for (auto& [p, g] : grads) p.mutable_grad() = g;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  }
  net.train(was_training);
  if (two < 0 || four < 0) return std::nullopt;
  m.per_sample = std::max(0.0, (four - two) / 2.0);
  m.fixed = std::max(0.0, two - 2.0 * m.per_sample);
  double trainable = 0;
  for (const auto& p : net.parameters())
    if (p.requires_grad()) trainable += static_cast<double>(p.numel()) * static_cast<double>(p.element_size());
  m.optimizer = 2.0 * trainable;
  return m;
}

void check_step_memory(config::Section& data_cfg, const StepMemory& m, double available) {
  if (m.total() <= available) return;
  data_cfg.fail("batch_size",
                fmt::format("a training step on {} samples needs about {} (measured by a forward and backward on 2 and 4 "
                            "samples: {} a sample, {} at any size, and {} of optimizer state), but only {} of memory is "
                            "available; lower data.batch_size (trainer.accumulate_grad_batches keeps the effective batch)",
                            m.batch, human_bytes(m.total()), human_bytes(m.per_sample), human_bytes(m.fixed),
                            human_bytes(m.optimizer), human_bytes(available)));
}

}  // namespace strobe
