// IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed.
#pragma once

#include <string>

#include <torch/types.h>

namespace strobe::data {

// Reads an IDX file of unsigned bytes (type 0x08) into a uint8 tensor of its declared shape.
// Throws DataError naming the file on a missing file, a wrong magic number, an unsupported element
// type, a truncated body or dimensions whose product overflows.
torch::Tensor read_idx_file(const std::string& path);

// Whole file contents, transparently gunzipped when it starts with the gzip magic.
std::string read_maybe_gzipped(const std::string& path);

}  // namespace strobe::data
