// How a GIoU loss prediction row finds its target row: one enum for the kernels (launchers.h) and
// the torch glue, whose op schemas carry it as an integer (strobe/ops/internal.h). No torch or CUDA
// header.
#pragma once

namespace strobe::ops::cuda {

//   kPadded:        target row r; valid when target[r][3] > 0 (zero-padded targets).
//   kPackedTargets: predictions padded [B, N, 4], targets packed [T, 4] with offsets[B + 1];
//                   r = b * N + j pairs with target offsets[b] + j, valid when j < offsets[b+1]-offsets[b].
//   kPacked:        predictions and targets both packed [T, 4]; every row valid.
enum class GiouLayout : int { kPadded = 0, kPackedTargets = 1, kPacked = 2 };

}  // namespace strobe::ops::cuda
