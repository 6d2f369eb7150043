// strobe_metrics_eval <manifest.json> <results.json> [--device cpu|cuda]
// Runs metric cases described by a manifest (written by tests/python/test_metrics*.py) through the
// C++ metrics and writes the computed values, so the Python test can compare them with TorchMetrics.
// Manifest: {"cases": [{"id", "metric", "options": {...}, "updates": [[tensor, tensor|null], ...]}]}
// with tensor = {"file" (raw little-endian data, relative to the manifest), "dtype", "shape"}.
// Results: {"<id>": {"shape": [...], "value": [floats; "nan", "inf", "-inf" as strings]}} or {"<id>": {"error": "..."}}.
#include "strobe/metrics/metric.h"
#include "strobe/metrics/registry.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace sm = strobe::metrics;
using nlohmann::json;

namespace {

torch::Dtype parse_dtype(const std::string& s) {
  if (s == "float32") return torch::kFloat;
  if (s == "float64") return torch::kDouble;
  if (s == "float16") return torch::kHalf;
  if (s == "bfloat16") return torch::kBFloat16;
  if (s == "int64") return torch::kLong;
  if (s == "int32") return torch::kInt;
  if (s == "bool") return torch::kBool;
  throw std::runtime_error("unknown dtype " + s);
}

torch::Tensor read_tensor(const std::filesystem::path& dir, const json& spec, const torch::Device& device) {
  if (spec.is_null()) return {};
  std::ifstream in(dir / spec.at("file").get<std::string>(), std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + (dir / spec.at("file").get<std::string>()).string());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<int64_t> shape = spec.at("shape").get<std::vector<int64_t>>();
  auto dtype = parse_dtype(spec.at("dtype").get<std::string>());
  auto t = torch::empty(shape, torch::TensorOptions().dtype(dtype));
  if (static_cast<size_t>(t.nbytes()) != bytes.size()) throw std::runtime_error("size mismatch for " + spec.dump());
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t.to(device);
}

sm::MetricOptions parse_options(const json& j, const torch::Device& device) {
  sm::MetricOptions o;
  o.device = device;
  if (j.contains("task")) o.task = sm::parse_task(j["task"]);
  if (j.contains("num_classes")) o.num_classes = j["num_classes"];
  if (j.contains("top_k")) o.top_k = j["top_k"];
  if (j.contains("average")) o.average = sm::parse_average(j["average"]);
  if (j.contains("threshold")) o.threshold = j["threshold"];
  if (j.contains("ignore_index") && !j["ignore_index"].is_null()) o.ignore_index = j["ignore_index"].get<int64_t>();
  if (j.contains("beta")) o.beta = j["beta"];
  if (j.contains("zero_division")) o.zero_division = j["zero_division"];
  if (j.contains("nan_strategy")) o.nan_strategy = sm::parse_nan_strategy(j["nan_strategy"]);
  if (j.contains("nan_replacement")) o.nan_replacement = j["nan_replacement"];
  if (j.contains("capacity")) o.capacity = j["capacity"];
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && !(argc == 5 && std::string(argv[3]) == "--device")) {
    std::cerr << "usage: " << argv[0] << " <manifest.json> <results.json> [--device cpu|cuda]\n";
    return 2;
  }
  const torch::Device device(argc == 5 ? argv[4] : "cpu");
  const std::filesystem::path manifest_path(argv[1]);
  json manifest = json::parse(std::ifstream(manifest_path));
  const auto dir = manifest_path.parent_path();
  json results = json::object();
  for (const auto& c : manifest.at("cases")) {
    const std::string id = c.at("id");
    try {
      auto metric = sm::make_metric(c.at("metric"), parse_options(c.value("options", json::object()), device));
      for (const auto& u : c.at("updates")) {
        metric->update(read_tensor(dir, u.at(0), device), u.size() > 1 ? read_tensor(dir, u.at(1), device) : torch::Tensor());
      }
      auto value = metric->compute().to(torch::kCPU, torch::kDouble).contiguous();
      json values = json::array();
      for (int64_t i = 0; i < value.numel(); ++i) {
        const double v = value.data_ptr<double>()[i];
        // JSON has no NaN/inf: non-finite values go as strings Python's float() parses.
        values.push_back(std::isfinite(v) ? json(v) : json(std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf")));
      }
      results[id] = {{"shape", value.sizes().vec()}, {"value", values}};
    } catch (const std::exception& e) {
      results[id] = {{"error", e.what()}};
    }
  }
  std::ofstream(argv[2]) << results.dump();
  return 0;
}
