// model_summary (Lightning's ModelSummary): at fit start, a table of the model's modules (name, type,
// parameters, trainable parameters) down to `max_depth` levels (1 by default; -1 every level; 0 no
// table, the totals only) and the totals: trainable, non-trainable, total parameters and their size
// in MB at the parameters' own dtypes; under trainer.fp8, every float8-capable linear layer and
// whether its GEMMs run in float8. A parameter shared by several modules (a tied embedding and
// head) counts once, as `sum(p.numel() for p in model.parameters())` counts it in PyTorch. Printed by
// rank 0 and written atomically to <run>/model_summary.txt. On by default through
// `trainer.enable_model_summary` (docs/CONFIG.md, "callbacks").
#include <cstdio>
#include <string>
#include <unordered_set>
#include <vector>

#include <c10/util/Type.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/callback.h"
#include "strobe/core/fp8.h"
#include "strobe/core/module.h"
#include "strobe/core/trainer_view.h"

namespace strobe {
namespace {

// Lightning's get_human_readable_count: "532 ", "9.4 K", "11.7 M", "1.2 B".
std::string summary_count(int64_t n) {
  const char* labels[] = {" ", "K", "M", "B", "T"};
  double v = static_cast<double>(n);
  int i = 0;
  while (v >= 999.95 && i < 4) v /= 1000.0, ++i;
  return i == 0 ? fmt::format("{} ", n) : fmt::format("{:.1f} {}", v, labels[i]);
}

// The module's class, without namespaces and libtorch's `Impl` suffix: "Conv2d", "ViTBlock".
std::string module_type_name(const torch::nn::Module& m) {
  std::string t = c10::demangle(typeid(m).name());
  const auto colon = t.rfind("::");
  if (colon != std::string::npos) t = t.substr(colon + 2);
  if (t.size() > 4 && t.compare(t.size() - 4, 4, "Impl") == 0) t.resize(t.size() - 4);
  return t;
}

struct ParamCounts {
  int64_t total = 0, trainable = 0;
  double bytes = 0;
};

// Every parameter of `m` and its descendants once (by storage identity, not by name).
ParamCounts count_params(const torch::nn::Module& m) {
  ParamCounts c;
  std::unordered_set<const void*> seen;
  for (const auto& p : m.parameters(/*recurse=*/true)) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    c.total += p.numel();
    if (p.requires_grad()) c.trainable += p.numel();
    c.bytes += static_cast<double>(p.numel()) * static_cast<double>(p.element_size());
  }
  return c;
}

class ModelSummary : public Callback {
 public:
  explicit ModelSummary(int64_t max_depth) : max_depth_(max_depth) {}
  std::string name() const override { return "model_summary"; }

  void on_fit_start(TrainerView& t, Module& module) override {
    if (!t.is_global_zero()) return;
    std::string text = summarize(module.net(), max_depth_);
    if (const Fp8Layers* fp8 = fp8_layers_of(module.net())) text += fp8->table();
    fmt::print("{}", text);
    std::fflush(stdout);
    if (t.run_dir().empty()) return;
    checkpoint::write_file_atomic(t.run_dir() + "/model_summary.txt", text);
  }

  static std::string summarize(const torch::nn::Module& net, int64_t max_depth) {
    struct Row {
      std::string name, type, params, trainable;
    };
    std::vector<Row> rows;
    if (max_depth != 0) {
      for (const auto& item : net.named_modules("", /*include_self=*/false)) {
        const int64_t depth = 1 + static_cast<int64_t>(std::count(item.key().begin(), item.key().end(), '.'));
        if (max_depth > 0 && depth > max_depth) continue;
        const ParamCounts c = count_params(*item.value());
        rows.push_back({item.key(), module_type_name(*item.value()), summary_count(c.total), summary_count(c.trainable)});
      }
    }
    const ParamCounts all = count_params(net);
    std::string out;
    if (!rows.empty()) {
      size_t wi = std::to_string(rows.size() - 1).size(), wn = 4, wt = 4, wp = 6, wr = 9;
      for (const auto& r : rows)
        wn = std::max(wn, r.name.size()), wt = std::max(wt, r.type.size()), wp = std::max(wp, r.params.size()),
        wr = std::max(wr, r.trainable.size());
      auto line = [&](const std::string& i, const std::string& n, const std::string& ty, const std::string& p,
                      const std::string& tr) {
        std::string l = fmt::format("{:<{}} | {:<{}} | {:<{}} | {:<{}} | {}", i, wi, n, wn, ty, wt, p, wp, tr);
        l.erase(l.find_last_not_of(' ') + 1);
        return l + "\n";
      };
      const std::string header = line("", "Name", "Type", "Params", "Trainable");
      const std::string rule(header.size() - 1, '-');
      out += header + rule + "\n";
      for (size_t i = 0; i < rows.size(); ++i)
        out += line(std::to_string(i), rows[i].name, rows[i].type, rows[i].params, rows[i].trainable);
      out += rule + "\n";
    }
    out += fmt::format("{:<10}Trainable params: {}\n", summary_count(all.trainable), all.trainable);
    out += fmt::format("{:<10}Non-trainable params: {}\n", summary_count(all.total - all.trainable), all.total - all.trainable);
    out += fmt::format("{:<10}Total params: {}\n", summary_count(all.total), all.total);
    out += fmt::format("{:<10.3f}Total estimated model params size (MB)\n", all.bytes / 1e6);
    return out;
  }

 private:
  int64_t max_depth_;
};

std::shared_ptr<Callback> make_model_summary(config::Section& cfg) {
  const int64_t max_depth = cfg.get_int("max_depth", 1, -1);
  cfg.finish();
  return std::make_shared<ModelSummary>(max_depth);
}

STROBE_REGISTER(callback_registry(), "model_summary", make_model_summary);

}  // namespace
}  // namespace strobe
