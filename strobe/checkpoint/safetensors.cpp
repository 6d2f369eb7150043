#include "strobe/checkpoint/safetensors.h"

#include <cstring>
#include <memory>
#include <utility>

#include <fmt/format.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/mapped_file.h"
#include "strobe/checkpoint/safetensors_format.h"

namespace strobe::safetensors {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");

using checkpoint::CheckpointError;

// Each safetensors dtype and its torch type.
constexpr std::pair<DType, torch::ScalarType> kTorchTypes[] = {
    {DType::kF64, torch::kFloat64}, {DType::kF32, torch::kFloat32}, {DType::kF16, torch::kFloat16},
    {DType::kBF16, torch::kBFloat16}, {DType::kI64, torch::kInt64},  {DType::kI32, torch::kInt32},
    {DType::kI16, torch::kInt16},    {DType::kI8, torch::kInt8},     {DType::kU8, torch::kUInt8},
    {DType::kBool, torch::kBool},
};

torch::ScalarType st_to_torch(DType dtype) {
  for (const auto& [d, type] : kTorchTypes)
    if (d == dtype) return type;
  throw CheckpointError("internal error: a safetensors dtype without a torch type");
}

bool st_from_torch(torch::ScalarType type, DType* out) {
  for (const auto& [d, t] : kTorchTypes) {
    if (t == type) {
      *out = d;
      return true;
    }
  }
  return false;
}

}  // namespace

File map_file(const std::string& path) {
  auto map = std::make_shared<const checkpoint::MappedFile>(path);
  Header header;
  try {
    header = parse_header(map->data(), map->size());
  } catch (const FormatError& e) {
    throw CheckpointError(fmt::format("{}: not a safetensors file: {}", path, e.what()));
  }
  File out;
  out.metadata = std::move(header.metadata);
  for (const auto& t : header.tensors) {
    if (t.dtype == DType::kBool) {
      out.unmapped_bool.push_back(t.name);
      continue;
    }
    const auto type = st_to_torch(t.dtype);
    void* data = const_cast<char*>(map->data() + header.data_start + t.begin);
    // The deleter holds the mapping: it lives as long as the last tensor over it.
    torch::Tensor tensor = t.end > t.begin ? torch::from_blob(data, t.shape, [map](void*) {}, torch::TensorOptions().dtype(type))
                                           : torch::empty(t.shape, torch::TensorOptions().dtype(type));
    out.tensors.emplace_back(t.name, std::move(tensor));
  }
  return out;
}

File read_file(const std::string& path) {
  const checkpoint::MappedFile map(path);
  Header header;
  try {
    header = parse_header(map.data(), map.size());
  } catch (const FormatError& e) {
    throw CheckpointError(fmt::format("{}: not a safetensors file: {}", path, e.what()));
  }
  File out;
  out.metadata = std::move(header.metadata);
  for (const auto& t : header.tensors) {
    torch::Tensor tensor = torch::empty(t.shape, torch::TensorOptions().dtype(st_to_torch(t.dtype)));
    if (t.end > t.begin) std::memcpy(tensor.data_ptr(), map.data() + header.data_start + t.begin, t.end - t.begin);
    if (t.dtype == DType::kBool) {
      // A bool byte other than 0 or 1 is undefined behaviour for torch's kernels: refuse it.
      const auto* b = static_cast<const uint8_t*>(tensor.data_ptr());
      for (uint64_t i = 0; i < t.end - t.begin; ++i)
        if (b[i] > 1)
          throw CheckpointError(fmt::format("{}: not a safetensors file: tensor '{}' (BOOL) holds the byte {} at element {}",
                                            path, t.name, static_cast<int>(b[i]), i));
    }
    out.tensors.emplace_back(t.name, std::move(tensor));
  }
  return out;
}

std::unique_ptr<checkpoint::PendingWrite> prepare_file(const std::string& path, const NamedTensors& tensors,
                                                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorEntry> entries;
  std::vector<torch::Tensor> data;
  for (const auto& [name, tensor] : tensors) {
    TensorEntry e;
    e.name = name;
    if (!st_from_torch(tensor.scalar_type(), &e.dtype))
      throw CheckpointError(fmt::format("{}: tensor '{}' has dtype {}, which safetensors files cannot hold", path, name,
                                        c10::toString(tensor.scalar_type())));
    e.shape = tensor.sizes().vec();
    entries.push_back(std::move(e));
    data.push_back(tensor.detach().to(torch::kCPU).contiguous());
  }
  std::string head;
  try {
    head = encode_header(entries, metadata);
  } catch (const FormatError& e) {
    throw CheckpointError(fmt::format("{}: {}", path, e.what()));
  }
  std::vector<checkpoint::ByteSpan> parts{{head.data(), head.size()}};
  for (const auto& t : data) parts.push_back({t.data_ptr(), static_cast<size_t>(t.nbytes())});
  return std::make_unique<checkpoint::PendingWrite>(path, parts);
}

void write_file(const std::string& path, const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  prepare_file(path, tensors, metadata)->commit();
}

}  // namespace strobe::safetensors
