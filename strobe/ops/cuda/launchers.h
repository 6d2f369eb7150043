// Launchers of the CUDA kernels behind the strobe ops: raw pointers, sizes and a stream only, no
// torch header, so nvcc compiles the kernels without libtorch and the torch glue
// (strobe/ops/*_cuda.cpp) stays plain C++. Every launcher enqueues on `stream` and never syncs.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "strobe/ops/cuda/dtype.h"
#include "strobe/ops/cuda/giou_layout.h"

namespace strobe::ops::cuda {

// ---- GIoU loss ----------------------------------------------------------------------------------
// How prediction row r finds its target row and whether it counts: GiouLayout (giou_layout.h).

struct GiouFwdParams {
  const void* pred = nullptr;  // [rows, 4], contiguous
  const void* target = nullptr;  // [target_rows, 4], contiguous
  const int64_t* offsets = nullptr;  // [num_images + 1] (kPackedTargets only)
  DType pred_dtype = DType::kFloat32;  // fp32, fp16, bf16
  DType target_dtype = DType::kFloat32;  // fp32, fp16, bf16, fp64
  GiouLayout layout = GiouLayout::kPadded;
  int64_t rows = 0;  // prediction rows
  int64_t target_rows = 0;
  int64_t boxes_per_image = 0;  // N (kPackedTargets only)
  int64_t num_images = 0;  // B (kPackedTargets only)
  float* per_box_loss = nullptr;  // [rows] or null (reduction none writes it)
  float* grad_box = nullptr;  // [rows, 4] d giou_r / d pred_r (0 for invalid rows) or null
  float* partial_sum = nullptr;  // [giou_fwd_num_blocks(rows)] or null (no reduction)
  int* partial_count = nullptr;  // [giou_fwd_num_blocks(rows)] or null
};

// Blocks of the forward launch: partial sums are reduced in this fixed order, so a given problem
// size always sums in the same order on any GPU (bitwise reproducible loss).
int64_t giou_fwd_num_blocks(int64_t rows);
cudaError_t giou_fwd(const GiouFwdParams& params, cudaStream_t stream);
// loss = sum (sum) or sum / max(count, 1) (mean); scale = d loss / d giou_r for a valid row.
cudaError_t giou_finalize(const float* partial_sum, const int* partial_count, int64_t num_partials,
                          bool mean, float* loss, float* scale, cudaStream_t stream);
// grad_pred[r] = grad_out * scale * grad_box[r] (grad_out a scalar), or grad_out[r] * grad_box[r]
// when per_box (reduction none, scale ignored). grad_pred has pred_dtype.
cudaError_t giou_bwd(const float* grad_out, bool per_box, const float* scale, const float* grad_box,
                     void* grad_pred, DType pred_dtype, int64_t rows, cudaStream_t stream);

// ---- Multi-tensor ops ---------------------------------------------------------------------------
// Tensors are described in the kernel parameters (no host-to-device copy, CUDA-graph safe); lists
// longer than the per-launch capacity take several launches. Kernel parameters above 4 KiB need
// CUDA 12.1+ and sm_70+ (we build for sm_90).
constexpr int kNonfiniteMaxTensors = 1000;
constexpr int kAdamMaxTensors = 300;
constexpr int kSgdMaxTensors = 500;

struct NonfiniteTensor {
  const void* data;
  int64_t numel;
  DType dtype;
};
// Number of partial slots a list needs (one per block over all launches).
int64_t nonfinite_num_partials(const NonfiniteTensor* tensors, int num_tensors);
// found = 1 if any element of any tensor is NaN or +-Inf, else 0; norm = sqrt(sum of squares)
// (only when norm != null). `partials` holds nonfinite_num_partials() floats and as many ints.
cudaError_t nonfinite_check(const NonfiniteTensor* tensors, int num_tensors, float* partial_sumsq,
                            int* partial_found, float* found, float* norm, cudaStream_t stream);

struct AdamTensor {
  float* param;  // fp32 master weights
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // amsgrad only
  float* step;  // per-parameter step count (device scalar), incremented unless skipped
  int64_t numel;
  DType grad_dtype;
};
// Scalars in double, as torch::optim computes them; the kernels round them to fp32 where
// torch::optim's ATen ops do.
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad;
  bool decoupled_weight_decay;  // AdamW (true) or Adam's L2 term (false)
  const float* found_nonfinite;  // skip everything when *found_nonfinite != 0 (null: never)
  const float* grad_multiplier;  // grads multiplied by *grad_multiplier (null: 1)
  const double* lr_device;  // when set, the learning rate is *lr_device (CUDA graphs), not lr
};
cudaError_t fused_adam(const AdamTensor* tensors, int num_tensors, const AdamHyper& hyper,
                       cudaStream_t stream);

struct SgdTensor {
  float* param;
  const void* grad;
  float* momentum_buffer;  // null when momentum == 0
  float* step;  // null when momentum == 0; 0 means the buffer is not yet initialised
  int64_t numel;
  DType grad_dtype;
};
struct SgdHyper {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
  const float* found_nonfinite;
  const float* grad_multiplier;
  const double* lr_device;  // when set, the learning rate is *lr_device (CUDA graphs), not lr
};
cudaError_t fused_sgd(const SgdTensor* tensors, int num_tensors, const SgdHyper& hyper,
                      cudaStream_t stream);

// The weight average's update: avg += weight * (src - avg) in fp32 for every tensor, skipped as a
// whole when *skip != 0 (read on the device).
constexpr int kEmaMaxTensors = 500;
struct EmaTensor {
  float* avg;
  const void* src;
  int64_t numel;
  DType src_dtype;
};
struct EmaHyper {
  float weight;
  const float* skip;  // null: never skipped
};
cudaError_t ema_update(const EmaTensor* tensors, int num_tensors, const EmaHyper& hyper, cudaStream_t stream);

}  // namespace strobe::ops::cuda
