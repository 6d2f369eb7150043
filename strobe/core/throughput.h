// What the throughput and device-stats monitors and `strobe bench` count, in one place: a batch's
// samples and real tokens, the device's dense peak FLOP/s by name and dtype (the table in
// throughput.cpp, sourced in docs/CONFIG.md "Dense peak FLOP/s"), the caching allocator's memory
// statistics and the process's resident memory. Every function here is host-side: none reads the
// device or waits for it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <torch/types.h>

#include "strobe/config/precision.h"
#include "strobe/data/batch.h"

namespace strobe {

// The batch's samples: the collate's batch_size.
int64_t batch_samples(const Batch& batch);
// The batch's real tokens: the token collates' num_tokens (padding not counted), else every element
// of "tokens", else 0 (not a token batch).
int64_t batch_tokens(const Batch& batch);

// The device's name as the driver reports it ("NVIDIA H100 80GB HBM3"); "cpu" for the CPU.
std::string device_name(const torch::Device& device);

// The dtype a precision's matrix multiplies run in: "32" -> fp32 (tf32 when cuBLAS may use TF32),
// bf16-mixed and bf16-master -> bf16, 16-mixed -> fp16.
std::string matmul_dtype(Precision precision);

struct DensePeak {
  std::string device;  // the table's row ("H100 SXM", "A100", ...)
  std::string dtype;   // fp32 | tf32 | bf16 | fp16 | fp8
  double flops = 0;    // dense (no structured sparsity) FLOP/s
};
// The dense peak of a device by its name and dtype; nullopt for a device or dtype not in the table.
std::optional<DensePeak> dense_peak(const std::string& device_name, const std::string& dtype);

struct DeviceMemory {
  double allocated = 0, reserved = 0, peak_allocated = 0;  // bytes
};
// The CUDA caching allocator's statistics of `device` (host-side counters, no device sync); nullopt
// for the CPU.
std::optional<DeviceMemory> device_memory(const torch::Device& device);
// The caching allocator's peak of `device` set to what is allocated now (a no-op on the CPU).
void reset_device_peak(const torch::Device& device);
// Frees the caching allocator's unused blocks of `device` back to the driver (a no-op on the CPU).
void release_cached_device_memory(const torch::Device& device);
// Bytes of `device` the driver can still give this process (cudaMemGetInfo's free); nullopt for the CPU.
std::optional<double> device_free_bytes(const torch::Device& device);
// This process's resident memory in bytes (/proc/self/statm); 0 when it cannot be read.
double resident_memory_bytes();

}  // namespace strobe
