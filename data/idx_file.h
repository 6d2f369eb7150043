// IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed.
#pragma once

#include <string>

#include <torch/types.h>

namespace strobe::data {

// Reads an IDX file of unsigned bytes (type 0x08) into a uint8 tensor of its declared shape.
// Throws std::runtime_error naming the file on a missing file, a wrong magic number, an
// unsupported element type or a truncated body.
torch::Tensor read_idx_file(const std::string& path);

// Whole file contents, transparently gunzipped when it starts with the gzip magic.
std::string read_maybe_gzipped(const std::string& path);

}  // namespace strobe::data
