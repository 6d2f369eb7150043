#include "strobe/core/throughput.h"

#include <unistd.h>

#include <cctype>
#include <fstream>

#include <torch/torch.h>

#ifdef STROBE_TORCH_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace strobe {

int64_t batch_samples(const Batch& batch) { return batch.batch_size(); }

int64_t batch_tokens(const Batch& batch) {
  if (auto it = batch.meta.find("num_tokens"); it != batch.meta.end()) return it->second;
  if (batch.has("tokens")) return batch.at("tokens").numel();
  return 0;
}

std::string device_name(const torch::Device& device) {
#ifdef STROBE_TORCH_HAS_CUDA
  if (device.is_cuda()) return at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index())->name;
#endif
  return device.str();
}

std::string matmul_dtype(Precision precision) {
  switch (precision) {
    case Precision::k32: return at::globalContext().allowTF32CuBLAS() ? "tf32" : "fp32";
    case Precision::kBf16Mixed:
    case Precision::kBf16Master: return "bf16";
    case Precision::k16Mixed: return "fp16";
  }
  return "fp32";
}

namespace {

// Dense peaks from NVIDIA's datasheets (TFLOP/s; the tensor-core figures there are with structured
// sparsity, halved here). 0: the dtype has no such path. docs/CONFIG.md, "Dense peak FLOP/s", lists
// the sources. Rows are matched in order by a whole word of the device's name, so "H100 NVL" and
// "H100 PCIe" come before "H100" (the SXM part, "NVIDIA H100 80GB HBM3").
struct PeakRow {
  const char* row;
  const char* match;
  double fp32, tf32, bf16, fp16, fp8;
};
constexpr PeakRow kPeaks[] = {
    {"GH200", "GH200", 67, 494.7, 989.4, 989.4, 1978.9},
    {"H200 NVL", "H200 NVL", 60, 417.5, 835.5, 835.5, 1670.5},
    {"H200 SXM", "H200", 67, 494.7, 989.4, 989.4, 1978.9},
    {"H100 NVL", "H100 NVL", 60, 417.5, 835.5, 835.5, 1670.5},
    {"H100 PCIe", "H100 PCIe", 51, 378, 756, 756, 1513},
    {"H100 SXM", "H100", 67, 494.7, 989.4, 989.4, 1978.9},
    {"A100", "A100", 19.5, 156, 312, 312, 0},
    {"L40S", "L40S", 91.6, 183, 362.05, 362.05, 733},
    {"L40", "L40", 90.5, 90.5, 181.05, 181.05, 362},
    {"L4", "L4", 30.3, 60, 121, 121, 242.5},
    {"A10", "A10", 31.2, 62.5, 125, 125, 0},
    {"V100", "V100", 15.7, 0, 0, 125, 0},
};

// `word` occurs in `name` with no letter or digit on either side.
bool has_word(const std::string& name, const std::string& word) {
  for (size_t at = name.find(word); at != std::string::npos; at = name.find(word, at + 1)) {
    const bool left = at == 0 || !std::isalnum(static_cast<unsigned char>(name[at - 1]));
    const size_t end = at + word.size();
    const bool right = end == name.size() || !std::isalnum(static_cast<unsigned char>(name[end]));
    if (left && right) return true;
  }
  return false;
}

}  // namespace

std::optional<DensePeak> dense_peak(const std::string& device_name, const std::string& dtype) {
  for (const auto& r : kPeaks) {
    if (!has_word(device_name, r.match)) continue;
    const double tflops = dtype == "fp32"   ? r.fp32
                          : dtype == "tf32" ? r.tf32
                          : dtype == "bf16" ? r.bf16
                          : dtype == "fp16" ? r.fp16
                          : dtype == "fp8"  ? r.fp8
                                            : 0;
    if (tflops <= 0) return std::nullopt;
    return DensePeak{r.row, dtype, tflops * 1e12};
  }
  return std::nullopt;
}

std::optional<DeviceMemory> device_memory(const torch::Device& device) {
#ifdef STROBE_TORCH_HAS_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    return DeviceMemory{static_cast<double>(stats.allocated_bytes[all].current),
                        static_cast<double>(stats.reserved_bytes[all].current),
                        static_cast<double>(stats.allocated_bytes[all].peak)};
  }
#endif
  (void)device;
  return std::nullopt;
}

void reset_device_peak(const torch::Device& device) {
#ifdef STROBE_TORCH_HAS_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
#endif
  (void)device;
}

void release_cached_device_memory(const torch::Device& device) {
#ifdef STROBE_TORCH_HAS_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  (void)device;
}

std::optional<double> device_free_bytes(const torch::Device& device) {
#ifdef STROBE_TORCH_HAS_CUDA
  if (device.is_cuda())
    return static_cast<double>(c10::cuda::CUDACachingAllocator::get()->getMemoryInfo(device.index() < 0 ? 0 : device.index()).first);
#endif
  (void)device;
  return std::nullopt;
}

double resident_memory_bytes() {
  std::ifstream in("/proc/self/statm");
  double size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return resident * static_cast<double>(::sysconf(_SC_PAGESIZE));
}

}  // namespace strobe
