// Image transforms of the image datasets, as boxes in the stored image's pixel coordinates plus one
// resampling pass, so that a crop + resize + flip + normalize touches each output pixel once and the
// decoder can downscale in the DCT domain first (the box maps onto the smaller image).
//
// Boxes follow torchvision: random_resized_crop is RandomResizedCrop's get_params (10 tries, then
// the central crop clamped to the ratio range); resize_center_crop is Resize(shorter side = resize)
// then CenterCrop(crop). Resampling is PIL's antialiased bilinear (a triangle filter widened by the
// downscale factor), the filter torchvision applies through PIL. All randomness comes from the
// caller's SampleRng, itself seeded from (seed, epoch, index).
#pragma once

#include <cstdint>

#include "data/image_codec.h"
#include "data/synthetic_rng.h"

namespace strobe::data {

struct CropBox {
  double x = 0, y = 0, w = 0, h = 0;  // in the stored image's pixels
};

CropBox random_resized_crop_box(int width, int height, double scale_lo, double scale_hi, double ratio_lo, double ratio_hi,
                                SampleRng& rng);
CropBox resize_center_crop_box(int width, int height, int resize, int crop);
CropBox whole_image_box(int width, int height);

// The DCT scale the decoder may use for `box` resampled to out_w x out_h (>= what the output needs).
double min_decode_scale(const CropBox& box, int out_w, int out_h);

// Resamples `box` (stored-image coordinates; `img` may be DCT-downscaled) to out_w x out_h.
// to_float: out[c][y][x] = (v / 255 - mean[c]) / std[c], mirrored horizontally when flip.
void resample_to_float(const Image& img, const CropBox& box, int out_w, int out_h, bool flip, const float* mean, const float* std,
                       float* out);
// to_u8: out[c][y][x], rounded (what PIL's resize returns), mirrored when flip.
void resample_to_u8(const Image& img, const CropBox& box, int out_w, int out_h, uint8_t* out, bool flip = false);

}  // namespace strobe::data
