#include "runner/lr_find.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>
#include <torch/torch.h>
#include <yaml-cpp/yaml.h>

#include "runner/experiment_builder.h"
#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/config.h"
#include "strobe/core/callback.h"
#include "strobe/core/trainer.h"
#include "strobe/core/trainer_view.h"
#include "strobe/distributed/launch_env.h"

namespace strobe {
namespace fs = std::filesystem;

std::optional<size_t> lr_suggestion(const std::vector<double>& lrs, const std::vector<double>& smoothed, int skip_begin,
                                    int skip_end) {
  const int64_t n = static_cast<int64_t>(std::min(lrs.size(), smoothed.size()));
  if (n - skip_begin - skip_end < 2) return std::nullopt;
  // As Lightning computes it: float32 tensors, the non-finite points dropped, torch.gradient with the
  // learning rates as coordinates, the first minimum.
  std::vector<float> l, x;
  std::vector<size_t> index;
  for (int64_t i = skip_begin; i < n - skip_end; ++i) {
    const float v = static_cast<float>(smoothed[i]);
    if (!std::isfinite(v)) continue;
    l.push_back(v), x.push_back(static_cast<float>(lrs[i])), index.push_back(static_cast<size_t>(i));
  }
  if (l.size() < 2) return std::nullopt;
  const auto losses = torch::tensor(l), coords = torch::tensor(x);
  const std::vector<at::Tensor> spacing{coords};
  const auto grad = at::gradient(losses, at::TensorList(spacing), std::optional<int64_t>(0), 1)[0];
  return index.at(static_cast<size_t>(grad.argmin().item<int64_t>()));
}

namespace {
// Lightning's running smoothing and stop rule, one loss at a time.
class LossSmoother {
 public:
  LossSmoother(double beta, double stop_factor) : beta_(beta), stop_factor_(stop_factor) {}
  // The smoothed value of the next loss; `diverged` when the sweep stops at it (it is still kept).
  double add(double loss, bool& diverged) {
    // Lightning counts the step after the optimizer's: the first loss is step 1, and its bias
    // correction is 1 - beta^(step + 1).
    ++step_;
    avg_ = beta_ * avg_ + (1 - beta_) * loss;
    const double smoothed = avg_ / (1 - std::pow(beta_, static_cast<double>(step_ + 1)));
    diverged = step_ > 1 && smoothed > stop_factor_ * best_;
    if (smoothed < best_ || step_ == 1) best_ = smoothed;
    return smoothed;
  }

 private:
  double beta_, stop_factor_, avg_ = 0, best_ = 0;
  int64_t step_ = 0;
};
}  // namespace

namespace {

// Records each optimizer step's learning rate (at its start) and loss (of its last micro-batch), and
// stops the run when the smoothed loss diverges.
class Recorder : public Callback {
 public:
  std::string name() const override { return "lr_find"; }
  void on_train_batch_start(TrainerView& t, Module&, const Batch&, int64_t) override {
    if (t.accumulated_batches() != 0 || !t.optimizer()) return;
    lrs.push_back(t.optimizer()->param_groups().front().options().get_lr());
  }
  void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor& loss, const Batch&, int64_t) override {
    if (t.accumulated_batches() != 0) return;
    if (stopped) return;  // a step run after the stop was asked for is not part of the sweep
    losses.push_back(loss.defined() ? loss.detach().to(torch::kCPU, torch::kDouble).item<double>()
                                    : std::numeric_limits<double>::quiet_NaN());
    bool diverged = false;
    smoothed.push_back(smoother.add(losses.back(), diverged));
    if (diverged || !std::isfinite(losses.back())) stopped = true, t.request_stop();
  }
  std::vector<double> lrs, losses, smoothed;
  LossSmoother smoother{0.98, 4.0};
  bool stopped = false;
};

std::string csv_text(const LrCurve& c, std::optional<size_t> pick) {
  std::string s = "step,lr,loss,smoothed_loss,suggested\n";
  for (size_t i = 0; i < c.smoothed.size(); ++i)
    s += fmt::format("{},{:.9g},{:.9g},{:.9g},{}\n", i, c.lrs[i], i < c.losses.size() ? c.losses[i] : c.smoothed[i], c.smoothed[i],
                     pick && *pick == i ? 1 : 0);
  return s;
}

LrCurve read_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw LrFindError(fmt::format("--from {}: cannot read the file", path));
  std::string line;
  std::getline(in, line);
  if (line.rfind("step,lr,loss,smoothed_loss", 0) != 0)
    throw LrFindError(fmt::format("--from {}: not an lr_find.csv (its first line should be 'step,lr,loss,smoothed_loss,...')", path));
  LrCurve c;
  int row = 1;
  while (std::getline(in, line)) {
    ++row;
    if (line.empty()) continue;
    std::stringstream ss(line);
    std::string f[4];
    for (auto& x : f) std::getline(ss, x, ',');
    try {
      c.lrs.push_back(std::stod(f[1])), c.losses.push_back(std::stod(f[2])), c.smoothed.push_back(std::stod(f[3]));
    } catch (const std::exception&) {
      throw LrFindError(fmt::format("--from {}:{}: expected numbers in lr, loss and smoothed_loss", path, row));
    }
    if (!(c.lrs.back() > 0)) throw LrFindError(fmt::format("--from {}:{}: the learning rate must be > 0", path, row));
  }
  if (c.lrs.empty()) throw LrFindError(fmt::format("--from {}: no rows", path));
  return c;
}

// Loss against learning rate on a log axis, the suggestion marked.
std::string svg_text(const LrCurve& c, std::optional<size_t> pick, const std::string& title) {
  constexpr double W = 720, H = 440, L = 70, R = 20, T = 40, B = 50;
  double x0 = std::log10(c.lrs.front()), x1 = std::log10(c.lrs.back());
  if (x1 <= x0) x1 = x0 + 1;
  double y0 = std::numeric_limits<double>::infinity(), y1 = -y0;
  for (double v : c.smoothed)
    if (std::isfinite(v)) y0 = std::min(y0, v), y1 = std::max(y1, v);
  if (!std::isfinite(y0)) y0 = 0, y1 = 1;
  if (y1 <= y0) y1 = y0 + 1;
  auto px = [&](double lr) { return L + (std::log10(lr) - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double v) { return T + (y1 - v) / (y1 - y0) * (H - T - B); };
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{2}\" y=\"22\" font-size=\"14\">{3}</text>\n",
      W, H, L, title);
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>\n", L, T, W - L - R, H - T - B);
  for (int d = static_cast<int>(std::ceil(x0)); d <= static_cast<int>(std::floor(x1)); ++d) {
    const double x = px(std::pow(10.0, d));
    s += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#ddd\"/><text x=\"{0:.1f}\" y=\"{3}\" "
                     "text-anchor=\"middle\">1e{4}</text>\n",
                     x, T, H - B, H - B + 16, d);
  }
  for (int k = 0; k <= 4; ++k) {
    const double v = y0 + (y1 - y0) * k / 4, y = py(v);
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.4g}</text>\n", L - 6, y + 4, v);
  }
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">learning rate (log scale)</text>\n", (L + W - R) / 2, H - 12);
  s += fmt::format("<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">smoothed loss</text>\n",
                   (T + H - B) / 2, (T + H - B) / 2);
  std::string pts;
  for (size_t i = 0; i < c.smoothed.size(); ++i)
    if (std::isfinite(c.smoothed[i])) pts += fmt::format("{:.1f},{:.1f} ", px(c.lrs[i]), py(c.smoothed[i]));
  s += fmt::format("<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"{}\"/>\n", pts);
  if (pick)
    s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"6\" fill=\"red\"/><text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"red\">suggested "
                     "lr {:.3g}</text>\n",
                     px(c.lrs[*pick]), py(c.smoothed[*pick]), px(c.lrs[*pick]) + 10, py(c.smoothed[*pick]) - 10, c.lrs[*pick]);
  return s + "</svg>\n";
}

void write_output(const fs::path& path, const std::string& bytes, bool overwrite) {
  std::error_code ec;
  if (!overwrite && fs::exists(path, ec))
    throw LrFindError(fmt::format("{} exists; give --overwrite to replace it, or another --out", path.string()));
  checkpoint::write_file_atomic(path.string(), bytes);
}

}  // namespace

int run_lr_find(const LrFindOptions& o) {
  if (!(o.min_lr > 0) || !(o.max_lr > o.min_lr) || !std::isfinite(o.max_lr))
    throw LrFindError(fmt::format("--min {:g} and --max {:g}: expected 0 < min < max", o.min_lr, o.max_lr));
  if (o.steps < 2) throw LrFindError(fmt::format("--steps {}: expected at least 2", o.steps));
  if (!o.apply.empty() && !o.from.empty()) throw LrFindError("--apply needs the config (-c), not --from");
  LrCurve curve;
  std::string title = "lr_find";
  std::optional<config::Document> loaded;
  if (!o.from.empty()) {
    curve = read_csv(o.from);
    title = "lr_find: " + o.from;
  } else {
    if (distributed::launch_env_from_process().world_size > 1)
      throw config::ConfigError("strobe tune lr runs as one process: start it without torchrun or srun");
    loaded.emplace(compose_experiment(o.configs, o.sets, o.plugins));
    config::Document& doc = *loaded;
    const YAML::Node opt = doc.root().node()["optimizer"];
    if (!opt.IsDefined() || !opt.IsMap() || !opt["name"].IsDefined())
      throw config::ConfigError(
          "strobe tune lr needs the optimizer built from the optimizer: section (the config has none; a task's own "
          "configure_optimizers cannot be swept)");
    config::Document sweep = doc.clone();
    for (const std::string& s :
         {fmt::format("optimizer.lr={:.17g}", o.min_lr),
          fmt::format("scheduler={{name: lr_range, end_factor: {:.17g}, steps: {}}}", o.max_lr / o.min_lr, o.steps),
          fmt::format("trainer.max_steps={}", o.steps), std::string("trainer.limit_val_batches=0"),
          std::string("trainer.num_sanity_val_steps=0")})
      sweep.apply_override(s);
    make_probe_run(sweep);
    RunOptions ro;
    ro.create_run_dir = false;
    auto recorder = std::make_shared<Recorder>();
    ro.extra_callbacks.push_back(recorder);
    auto run = build_run(sweep, ro);
    fmt::print("strobe tune lr: {} steps from lr {:g} to {:g} on {}\n", o.steps, o.min_lr, o.max_lr,
               run->trainer->view().device().str());
    std::fflush(stdout);
    run->trainer->fit();
    curve.losses = recorder->losses;
    curve.smoothed = recorder->smoothed;
    curve.lrs.assign(recorder->lrs.begin(), recorder->lrs.begin() + static_cast<int64_t>(curve.smoothed.size()));
    title = fmt::format("lr_find: {}", o.configs.front());
  }
  const auto pick = lr_suggestion(curve.lrs, curve.smoothed);
  std::error_code ec;
  fs::create_directories(o.out, ec);
  if (ec) throw LrFindError(fmt::format("--out {}: cannot create the folder ({})", o.out, ec.message()));
  write_output(fs::path(o.out) / "lr_find.csv", csv_text(curve, pick), o.overwrite);
  write_output(fs::path(o.out) / "lr_find.svg", svg_text(curve, pick, title), o.overwrite);
  const bool stopped = o.from.empty() && static_cast<int64_t>(curve.smoothed.size()) < o.steps;
  fmt::print("strobe tune lr: {} points{}; {}/lr_find.csv and lr_find.svg\n", curve.smoothed.size(),
             stopped ? " (stopped: the smoothed loss passed 4x its best)" : "", o.out);
  if (!pick) {
    fmt::print("strobe tune lr: no suggestion: fewer than 2 finite points after the first 10 and the last (raise --steps or "
               "--max)\n");
    return 1;
  }
  const double lr = curve.lrs[*pick];
  fmt::print("strobe tune lr: suggested lr {:.6g} (step {}, smoothed loss {:.6g})\n", lr, *pick, curve.smoothed[*pick]);
  if (!o.apply.empty()) {
    // The composed config (every -c file merged, every --set applied) with the suggestion, emitted
    // again by yaml-cpp: the files' comments are not carried over.
    loaded->apply_override(fmt::format("optimizer.lr={:.6g}", lr));
    YAML::Emitter e;
    e << loaded->root().node();
    write_output(o.apply, std::string("# written by strobe tune lr: optimizer.lr is its suggestion\n") + e.c_str() + "\n",
                 o.overwrite);
    fmt::print("strobe tune lr: wrote {} (the config with optimizer.lr: {:.6g})\n", o.apply, lr);
  }
  return 0;
}

}  // namespace strobe
