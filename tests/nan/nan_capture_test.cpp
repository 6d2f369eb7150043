// NaN capture and replay on CPU: the capture holds the pre-corruption state, replay reproduces the
// step bit for bit (dropout included, through the restored RNG) and names the op and module, and
// `action: skip_step` drops exactly the bad steps.
//
// The probe model injects a fault whose trigger depends on the batch alone (its mean input value
// above a threshold), so a test knows on the host which steps must go bad.
#include <deque>
#include <random>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/config.h"
#include "strobe/core/activation_checkpoint.h"
#include "strobe/core/capture.h"
#include "strobe/core/forensics.h"
#include "strobe/ops/ops.h"
#include "strobe/core/model.h"
#include "strobe/core/step_pipeline.h"
#include "runner/experiment_builder.h"
#include "runner/replay.h"
#include "tests/trainer/trainer_test_util.h"

namespace strobe {
namespace {

namespace fs = std::filesystem;

// fc1 -> relu -> dropout -> batchnorm -> faulty (proj + fault) -> head.
// fault "forward": y + 0 * log(threshold - mean(x)): NaN from aten::log once mean(x) > threshold.
// fault "backward": y + 0 * sqrt(a) with a = 0 * (mean(h) - 1) once mean(x) > threshold: finite
// forward, NaN parameter gradients (0 * inf in sqrt's backward).
struct FaultyImpl : torch::nn::Module {
  FaultyImpl(int64_t width, std::string fault, double threshold)
      : proj(register_module("proj", torch::nn::Linear(width, width))), fault(std::move(fault)), threshold(threshold) {}
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& x_mean, const torch::Tensor& x_rows) {
    ModuleScope scope("faulty");
    auto y = proj->forward(h);
    if (fault == "forward") return y + 0 * torch::log(threshold - x_mean);
    if (fault == "backward") {
      // The NaN must reach parameter gradients: `a` depends on h (fc1, bn) through a zero factor.
      auto hm = h.mean();
      auto a = torch::where(x_mean > threshold, (hm - 1) * 0, torch::ones_like(hm) + 0 * hm);
      return y + 0 * torch::sqrt(a);
    }
    // A finite loss spike: the activations scaled up a thousandfold on the chosen batches.
    if (fault == "spike") return y * torch::where(x_mean > threshold, torch::full({}, 1000.0), torch::full({}, 1.0));
    // NaN in the rows whose own mean input exceeds the threshold (a bad sample), in every precision.
    if (fault == "rows") return y + 0 * torch::log(threshold - x_rows);
    // exp(98) overflows float32 (e^88.7) but not float64: a precision fault on the chosen batches.
    if (fault == "overflow") return y + 0 * torch::exp(88.0 + 10.0 * (x_mean > threshold).to(y.scalar_type()));
    return y;
  }
  torch::nn::Linear proj;
  std::string fault;
  double threshold;
};
TORCH_MODULE(Faulty);

class NanProbe : public Model {
 public:
  NanProbe(int64_t in, int64_t width, int64_t classes, double dropout, std::string fault, double threshold, bool noise,
           bool nan_weight, bool checkpoint)
      : Model("NanProbe"),
        fc1(register_module("fc1", torch::nn::Linear(in, width))),
        drop(register_module("drop", torch::nn::Dropout(dropout))),
        bn(register_module("bn", torch::nn::BatchNorm1d(width))),
        faulty(register_module("faulty", Faulty(width, std::move(fault), threshold))),
        head(register_module("head", torch::nn::Linear(width, classes))),
        noise(noise),
        checkpoint(checkpoint) {
    if (nan_weight) {
      torch::NoGradGuard ng;
      faulty->proj->weight[0][0] = NAN;  // a corrupt initial weight (a bad file loaded for fine-tuning)
    }
  }
  torch::Tensor forward(const Batch& batch) override {
    auto x = batch.at("image").flatten(1);
    auto h = bn->forward(drop->forward(torch::relu(fc1->forward(x))));
    torch::Tensor y;
    if (checkpoint) {  // faulty as a checkpointed block (strobe/core/activation_checkpoint.h)
      auto f = faulty.ptr();
      y = checkpoint_block(*f, {h, x}, [f](const std::vector<torch::Tensor>& t) {
        return std::vector<torch::Tensor>{f->forward(t[0], t[1].mean(), t[1].mean(1, /*keepdim=*/true))};
      })[0];
    } else {
      y = faulty->forward(h, x.mean(), x.mean(1, /*keepdim=*/true));
    }
    auto out = head->forward(torch::relu(y));
    // Outside the captured RNG state: the step's loss differs from one run to the next.
    if (noise) out = out * (1.0 + 1e-3 * static_cast<double>(1 + std::random_device{}() % 1000));
    return out;
  }
  std::string default_task() const override { return "classification"; }
  torch::nn::Linear fc1;
  torch::nn::Dropout drop;
  torch::nn::BatchNorm1d bn;
  Faulty faulty;
  torch::nn::Linear head;
  bool noise;
  bool checkpoint;
};

std::shared_ptr<Model> make_probe(config::Section& cfg) {
  auto in = cfg.get_int("in_features", 16, 1);
  auto width = cfg.get_int("width", 16, 1);
  auto classes = cfg.get_int("num_classes", 4, 1);
  auto dropout = cfg.get_double("dropout", 0.3, 0.0, 0.99);
  auto fault = cfg.get_choice("fault", "none", {"none", "forward", "backward", "spike", "rows", "overflow"});
  auto threshold = cfg.get_double("threshold", 1e9);
  auto noise = cfg.get_bool("noise", false);
  auto nan_weight = cfg.get_bool("nan_weight", false);
  auto checkpoint = cfg.get_bool("checkpoint", false);
  cfg.finish();
  return std::make_shared<NanProbe>(in, width, classes, dropout, fault, threshold, noise, nan_weight, checkpoint);
}
STROBE_REGISTER(model_registry(), "nan_probe", make_probe);

std::string probe_yaml(const std::string& fault, double threshold, const std::string& callbacks, int64_t max_steps = 12) {
  return fmt::format(R"(name: nan_probe
seed: 3
trainer:
  max_epochs: 1
  max_steps: {}
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
  device: cpu
model:
  name: nan_probe
  in_features: 16
  width: 16
  num_classes: 4
  dropout: 0.3
  fault: {}
  threshold: {:.17g}
data:
  name: synthetic_images
  image_size: 4
  channels: 1
  num_classes: 4
  num_samples: 256
  num_val_samples: 16
  batch_size: 8
  num_workers: 1
optimizer:
  name: adamw
  lr: 0.01
scheduler:
  name: none
callbacks: {}
)",
                     max_steps, fault, threshold, callbacks);
}

// The trainer tests' helpers (tests/trainer/trainer_test_util.h): an empty run_dir means no files.
std::unique_ptr<Run> make_run(const std::string& yaml, const std::string& run_dir,
                              std::vector<std::shared_ptr<Callback>> extra = {}) {
  return strobe::testing::make_run(yaml, {}, run_dir, std::nullopt, std::move(extra));
}
using strobe::testing::temp_dir;

// Mean input value of the first n training batches, in the order training sees them.
std::vector<double> batch_means(int64_t n) { return strobe::testing::batch_means(probe_yaml("none", 1e9, "[]"), n); }

// A threshold that the batch at `first_bad` is the first to exceed (and `extra` later ones).
double threshold_first_bad_at(const std::vector<double>& means, size_t first_bad, size_t* bad_count = nullptr) {
  double earlier_max = -1e9;
  for (size_t i = 0; i < first_bad; ++i) earlier_max = std::max(earlier_max, means[i]);
  EXPECT_GT(means[first_bad], earlier_max) << "pick another first_bad: the data decides";
  const double thr = (earlier_max + means[first_bad]) / 2;
  if (bad_count) {
    *bad_count = 0;
    for (double m : means) *bad_count += m > thr;
  }
  return thr;
}

// The first index >= from whose mean exceeds all earlier ones (a usable first bad step).
size_t first_exceeding(const std::vector<double>& means, size_t from) {
  const auto r = strobe::testing::first_rise(means, [from](size_t i) { return i >= from; });
  return r ? r->index : means.size();
}

std::map<std::string, torch::Tensor> model_state(Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& p : m.net().named_parameters()) out["model/" + p.key()] = p.value().detach().clone();
  for (auto& b : m.net().named_buffers()) out["model/" + b.key()] = b.value().clone();
  return out;
}

void expect_bitwise_equal(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, t] : a) {
    auto it = b.find(k);
    ASSERT_NE(it, b.end()) << k;
    EXPECT_TRUE(torch::equal(t, it->second)) << k << " differs";
  }
}

// AdamW state per parameter, in parameter order (the archive's bytes depend on pointer order).
std::vector<torch::Tensor> adamw_state(torch::optim::Optimizer& opt) {
  std::vector<torch::Tensor> out;
  for (auto& group : opt.param_groups())
    for (auto& p : group.params()) {
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) {
        out.push_back(torch::full({1}, -1.0));
        continue;
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      out.push_back(torch::full({1}, static_cast<double>(s.step())));
      out.push_back(s.exp_avg().clone());
      out.push_back(s.exp_avg_sq().clone());
    }
  return out;
}

void expect_same_optimizer_state(torch::optim::Optimizer& a, torch::optim::Optimizer& b) {
  auto x = adamw_state(a), y = adamw_state(b);
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(torch::equal(x[i], y[i])) << "optimizer state entry " << i;
}

TEST(NanCapture, ForwardNaNStopsWithExit3AndCapturesPreCorruptionState) {
  auto means = batch_means(12);
  const size_t bad = first_exceeding(means, 4);
  ASSERT_LT(bad, means.size());
  const double thr = threshold_first_bad_at(means, bad);
  const auto dir = temp_dir("nan-forward");
  {
    auto run = make_run(probe_yaml("forward", thr, "[{name: nan_capture}]"), dir);
    EXPECT_EQ(run->trainer->fit(), 3);
  }
  // Batch `bad` (0-based) is step bad + 1: its metrics.csv row and its capture's name.
  const fs::path cap = fs::path(dir) / "nan" / fmt::format("step_{}", bad + 1);
  ASSERT_TRUE(fs::exists(cap / capture::kCheckpointFile)) << cap;
  auto d = checkpoint::load_checkpoint_file((cap / capture::kCheckpointFile).string());
  auto info = nlohmann::json::parse(d.blob("capture"));
  EXPECT_EQ(info["step"], bad + 1);
  EXPECT_EQ(info["global_step"], bad);  // the steps completed before it (the loop state restored)
  EXPECT_TRUE(info["loss_nonfinite"].get<bool>());
  EXPECT_EQ(capture::get_batches(d).size(), 1u);

  // The weights and buffers equal those of a run stopped right before the failing step.
  auto ref = make_run(probe_yaml("forward", thr, "[]", static_cast<int64_t>(bad)), temp_dir("nan-forward-ref"));
  EXPECT_EQ(ref->trainer->fit(), 0);
  std::map<std::string, torch::Tensor> captured;
  for (const auto& [k, t] : d.tensors)
    if (k.rfind("model/", 0) == 0) captured[k] = t;
  expect_bitwise_equal(model_state(*ref->module), captured);
  // Optimizer state too: the capture loaded into a fresh run holds the reference run's moments and steps.
  auto loaded = make_run(probe_yaml("forward", thr, "[]"), "");
  loaded->trainer->resume_state(d);
  expect_same_optimizer_state(*ref->trainer->view().optimizer(), *loaded->trainer->view().optimizer());

  auto report = capture::replay_capture(dir + "/nan", {});
  EXPECT_TRUE(report["exact"].get<bool>()) << report.dump(2);
  ASSERT_FALSE(report["first_nonfinite"].is_null()) << report.dump(2);
  EXPECT_EQ(report["first_nonfinite"]["op"], "aten::log") << report.dump(2);
  EXPECT_EQ(report["first_nonfinite"]["module"], "faulty") << report.dump(2);
  EXPECT_EQ(report["first_nonfinite"]["phase"], "forward");
  EXPECT_TRUE(report["first_nonfinite"]["inputs_finite"].get<bool>());
  EXPECT_GT(report["first_nonfinite"]["output"]["nan"].get<int64_t>(), 0);
  EXPECT_NE(capture::format_replay_report(report).find("EXACT"), std::string::npos);
}

// The faulty module as a checkpointed block: its forward runs without a graph and is recomputed in
// backward, and replay still names the op and the module, in the forward and in the backward.
TEST(NanCapture, ReplayNamesTheModuleInsideACheckpointedBlock) {
  auto means = batch_means(12);
  const size_t bad = first_exceeding(means, 3);
  ASSERT_LT(bad, means.size());
  const double thr = threshold_first_bad_at(means, bad);
  for (const std::string fault : {"forward", "backward"}) {
    const auto dir = temp_dir("nan-ckpt-" + fault);
    auto yaml = probe_yaml(fault, thr, "[{name: nan_capture, check: grads}]");
    yaml.replace(yaml.find("  fault:"), 0, "  checkpoint: true\n");
    {
      auto run = make_run(yaml, dir);
      ASSERT_EQ(run->trainer->fit(), 3) << fault;
    }
    auto report = capture::replay_capture(capture::resolve_capture_dir(dir + "/nan"), {});
    EXPECT_TRUE(report["exact"].get<bool>()) << report.dump(2);
    ASSERT_FALSE(report["first_nonfinite"].is_null()) << report.dump(2);
    const auto& first = report["first_nonfinite"];
    EXPECT_EQ(first["module"], "faulty") << fault << " " << first.dump(2);
    EXPECT_EQ(first["phase"], fault) << first.dump(2);
    EXPECT_EQ(first["op"], fault == "forward" ? "aten::log" : "aten::div") << first.dump(2);
    if (fault == "backward")  // sqrt's backward, linked to the recomputed aten::sqrt of the block
      EXPECT_NE(first["note"].get<std::string>().find("in the backward of aten::sqrt (faulty)"), std::string::npos)
          << first.dump(2);
  }
}

TEST(NanCapture, DropoutReplaysExactlyOnlyWithTheCapturedRngState) {
  auto means = batch_means(12);
  const size_t bad = first_exceeding(means, 3);
  ASSERT_LT(bad, means.size());
  const auto dir = temp_dir("nan-rng");
  {
    // Backward fault: the failing step's loss is finite, so its bits depend on the dropout mask.
    auto run = make_run(probe_yaml("backward", threshold_first_bad_at(means, bad), "[{name: nan_capture}]"), dir);
    ASSERT_EQ(run->trainer->fit(), 3);
  }
  const std::string cap = capture::resolve_capture_dir(dir + "/nan");
  auto exact = capture::replay_capture(cap, {});
  EXPECT_TRUE(exact["exact"].get<bool>()) << exact.dump(2);
  EXPECT_NE(exact["loss"]["replayed"][0]["value"].get<std::string>(), "nan");
  // Negative control: the same capture with another CPU generator state draws other dropout masks.
  auto d = checkpoint::load_checkpoint_file(cap + "/" + capture::kCheckpointFile);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12345);
  d.tensors["rng/cpu"] = gen.get_state();
  checkpoint::save_checkpoint_file(cap + "/" + capture::kCheckpointFile, d);
  auto report = capture::replay_capture(cap, {});
  EXPECT_FALSE(report["exact"].get<bool>()) << report.dump(2);
  EXPECT_FALSE(report["loss"]["bits_equal"].get<bool>());
}

TEST(NanCapture, FiniteLossWithNaNGradientsIsCaughtByTheGradientCheck) {
  auto means = batch_means(12);
  const size_t bad = first_exceeding(means, 2);
  ASSERT_LT(bad, means.size());
  const double thr = threshold_first_bad_at(means, bad);
  const auto dir = temp_dir("nan-backward");
  {
    auto run = make_run(probe_yaml("backward", thr, "[{name: nan_capture, check: grads}]"), dir);
    EXPECT_EQ(run->trainer->fit(), 3);
  }
  auto d = checkpoint::load_checkpoint_file(capture::resolve_capture_dir(dir + "/nan") + "/" + capture::kCheckpointFile);
  auto info = nlohmann::json::parse(d.blob("capture"));
  EXPECT_EQ(info["global_step"], bad);
  EXPECT_FALSE(info["loss_nonfinite"].get<bool>());
  EXPECT_TRUE(info["grads_nonfinite"].get<bool>());
  EXPECT_FALSE(info["nonfinite_grads"].empty());
  auto report = capture::replay_capture(dir + "/nan", {});
  EXPECT_TRUE(report["exact"].get<bool>()) << report.dump(2);
  ASSERT_FALSE(report["first_nonfinite"].is_null());
  EXPECT_EQ(report["first_nonfinite"]["phase"], "backward") << report.dump(2);

  // With only the loss checked, the NaN gradients are applied: the next step's loss is what goes
  // non-finite, and the capture (one step late) holds corrupted weights, which replay points out.
  const auto late = temp_dir("nan-backward-loss");
  auto run = make_run(probe_yaml("backward", thr, "[{name: nan_capture, check: loss}]"), late);
  EXPECT_EQ(run->trainer->fit(), 3);
  auto late_report = capture::replay_capture(late + "/nan", {});
  EXPECT_EQ(late_report["global_step"].get<int64_t>(), static_cast<int64_t>(bad) + 1);
  EXPECT_NE(late_report["notes"].dump().find("already non-finite before the step"), std::string::npos) << late_report.dump(2);
}

// Records the whole training state around every optimizer step.
class StateRecorder : public Callback {
 public:
  std::string name() const override { return "state_recorder"; }
  void on_train_batch_start(TrainerView& t, Module& m, const Batch& b, int64_t) override {
    before = model_state(m);
    opt_before = t.make_checkpoint().blob("optimizer");
    bad_batch = b.at("image").flatten(1).mean().item<double>() > threshold;
  }
  void on_train_batch_end(TrainerView& t, Module& m, const torch::Tensor&, const Batch&, int64_t) override {
    auto after = model_state(m);
    bool same = true;
    for (const auto& [k, v] : before) same = same && torch::equal(v, after.at(k));
    const bool opt_same = t.make_checkpoint().blob("optimizer") == opt_before;
    if (bad_batch) {
      ++bad_steps;
      unchanged_on_bad += same && opt_same;
    } else {
      changed_on_good += !same && !opt_same;
      ++good_steps;
    }
  }
  double threshold = 0;
  std::map<std::string, torch::Tensor> before;
  std::string opt_before;
  bool bad_batch = false;
  int bad_steps = 0, good_steps = 0, unchanged_on_bad = 0, changed_on_good = 0;
};

TEST(NanCapture, SkipStepDropsExactlyTheBadStepsBitwise) {
  auto means = batch_means(24);
  const size_t first = first_exceeding(means, 1);
  size_t bad_count = 0;
  const double thr = threshold_first_bad_at(means, first, &bad_count);
  ASSERT_GE(bad_count, 1u);
  const auto dir = temp_dir("nan-skip");
  auto rec = std::make_shared<StateRecorder>();
  rec->threshold = thr;
  auto run = make_run(probe_yaml("forward", thr, "[{name: nan_capture, action: skip_step}]", 24), dir, {rec});
  EXPECT_EQ(run->trainer->fit(), 0);
  EXPECT_EQ(run->trainer->view().state().global_step, 24);
  EXPECT_EQ(rec->bad_steps, static_cast<int>(bad_count));
  EXPECT_EQ(rec->unchanged_on_bad, rec->bad_steps);  // weights, buffers and optimizer state untouched
  EXPECT_EQ(rec->changed_on_good, rec->good_steps);  // every good step trained
  EXPECT_GT(rec->good_steps, 0);
  run->trainer->view().drain_metrics();
  ASSERT_TRUE(run->trainer->view().metrics().count("train/skipped_steps"));
  EXPECT_EQ(run->trainer->view().metrics().at("train/skipped_steps"), static_cast<double>(bad_count));
  for (auto& p : run->module->net().parameters()) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
  EXPECT_FALSE(fs::exists(fs::path(dir) / "nan"));
}

// The ema callback under skip_step: a skipped step moves no average (the skip flag read on the
// device), the others do; the averages (BatchNorm statistics included) equal a float64 reference of
// the weights after each applied step.
class AppliedWeights : public Callback {
 public:
  std::string name() const override { return "applied_weights"; }
  void on_before_zero_grad(TrainerView& t, Module&, torch::optim::Optimizer&) override {
    std::map<std::string, torch::Tensor> w;
    for (auto& [name, tensor] : t.weights()) w[name] = tensor.to(torch::kFloat64, false, true);
    steps.push_back(std::move(w));
    applied.push_back(t.step_access().step_pipeline().last().skipped.item<float>() == 0.f);
  }
  std::vector<std::map<std::string, torch::Tensor>> steps;
  std::vector<bool> applied;
};

TEST(NanCapture, EmaMovesOnlyOnAppliedSteps) {
  auto means = batch_means(24);
  size_t bad_count = 0;
  const double thr = threshold_first_bad_at(means, first_exceeding(means, 1), &bad_count);
  ASSERT_GE(bad_count, 1u);
  auto rec = std::make_shared<AppliedWeights>();
  auto run = make_run(probe_yaml("forward", thr, "[{name: nan_capture, action: skip_step}, {name: ema, decay: 0.8}]", 24), "", {rec});
  ASSERT_EQ(run->trainer->fit(), 0);
  ASSERT_EQ(rec->steps.size(), 24u);
  size_t skipped = 0;
  std::map<std::string, torch::Tensor> avg;
  for (size_t i = 0; i < rec->steps.size(); ++i) {
    const double d = i == 0 ? 0.0 : std::min(0.8, 1.0 - std::pow(1.0 + static_cast<double>(i), -2.0 / 3.0));
    if (!rec->applied[i]) {
      ++skipped;
      continue;
    }
    for (auto& [name, w] : rec->steps[i]) avg[name] = avg.count(name) ? d * avg[name] + (1 - d) * w : w;
  }
  EXPECT_EQ(skipped, bad_count);
  const auto ckpt = run->trainer->view().make_checkpoint();
  ASSERT_FALSE(avg.empty());
  for (const auto& [name, want] : avg) {
    ASSERT_TRUE(ckpt.tensors.count("ema/" + name)) << name;
    const double err = (ckpt.tensors.at("ema/" + name).to(torch::kFloat64) - want).abs().max().item<double>();
    EXPECT_LT(err, 2e-6 * std::max(want.abs().max().item<double>(), 1.0)) << name;
  }
  EXPECT_TRUE(ckpt.tensors.count("ema/bn.running_mean"));
}

TEST(NanCapture, SkipStepStopsWithACaptureOnceMaxSkipsIsSpent) {
  auto means = batch_means(48);
  const size_t first = first_exceeding(means, 1);
  size_t bad_count = 0;
  const double thr = threshold_first_bad_at(means, first, &bad_count);
  ASSERT_GE(bad_count, 2u) << "the data should give two bad batches in 48";
  const auto dir = temp_dir("nan-maxskips");
  auto run = make_run(probe_yaml("forward", thr, "[{name: nan_capture, action: skip_step, max_skips: 1}]", 48), dir);
  EXPECT_EQ(run->trainer->fit(), 3);
  auto report = capture::replay_capture(dir + "/nan", {});
  EXPECT_TRUE(report["exact"].get<bool>()) << report.dump(2);
  EXPECT_GT(report["global_step"].get<int64_t>(), static_cast<int64_t>(first));
}

TEST(NanCapture, ReplayRefusesWhatIsNotACapture) {
  const auto dir = temp_dir("nan-bad");
  EXPECT_THROW(capture::replay_capture(dir, {}), checkpoint::CheckpointError);
  EXPECT_THROW(capture::replay_capture(dir + "/missing", {}), checkpoint::CheckpointError);
  fs::create_directories(fs::path(dir) / "step_3");
  std::ofstream(fs::path(dir) / "step_3" / capture::kCheckpointFile) << "truncated";
  EXPECT_THROW(capture::replay_capture(dir, {}), checkpoint::CheckpointError);
}

// Two runs sharing nan_capture.dirpath that fail at the same step: the second capture takes the next
// free name (step_<N>.1) and the first stays byte for byte; both replay.
TEST(NanCapture, RunsSharingACaptureDirectoryNeverReplaceEachOthersCaptures) {
  auto means = batch_means(12);
  const size_t bad = first_exceeding(means, 4);
  ASSERT_LT(bad, means.size());
  const auto shared = temp_dir("nan-shared");
  const std::string callbacks = "[{name: nan_capture, dirpath: " + shared + "}]";
  const fs::path first = fs::path(shared) / fmt::format("step_{}", bad + 1);
  const fs::path second = fs::path(shared) / fmt::format("step_{}.1", bad + 1);
  std::string before;
  for (int run_index = 0; run_index < 2; ++run_index) {
    auto run = make_run(probe_yaml("forward", threshold_first_bad_at(means, bad), callbacks), temp_dir("nan-shared-run"));
    ASSERT_EQ(run->trainer->fit(), 3);
    if (run_index == 0) {
      std::ifstream in(first / capture::kCheckpointFile, std::ios::binary);
      before.assign(std::istreambuf_iterator<char>(in), {});
    }
  }
  std::ifstream in(first / capture::kCheckpointFile, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), before) << "the second run replaced the first's capture";
  ASSERT_TRUE(fs::exists(second / capture::kCheckpointFile)) << second;
  for (const auto& dir : {first, second}) EXPECT_TRUE(capture::replay_capture(dir.string(), {})["exact"].get<bool>()) << dir;
  for (const auto& e : fs::directory_iterator(shared))
    EXPECT_NE(e.path().filename().string()[0], '.') << e.path() << " left behind";
}

// A capture is checked against its own record before it is replayed: one whose record counts more
// micro-batches than it holds (it was reported EXACT), a batch record that is not JSON, no batches, a
// symlink loop: each a CheckpointError (exit 2) naming the file and what is wrong.
TEST(NanCapture, ReplayRefusesAnIncompleteOrDamagedCaptureNamingWhatIsWrong) {
  auto means = batch_means(12);
  const size_t bad = first_exceeding(means, 4);
  ASSERT_LT(bad, means.size());
  const auto dir = temp_dir("nan-damaged");
  {
    auto run = make_run(probe_yaml("forward", threshold_first_bad_at(means, bad), "[{name: nan_capture}]"), dir);
    ASSERT_EQ(run->trainer->fit(), 3);
  }
  const fs::path cap = fs::path(dir) / "nan" / fmt::format("step_{}", bad + 1);
  const auto good = checkpoint::load_checkpoint_file((cap / capture::kCheckpointFile).string());
  auto damaged = [&](const std::string& tag, const std::function<void(checkpoint::CheckpointData&)>& edit, const std::string& want) {
    auto d = good;
    edit(d);
    const fs::path to = fs::path(dir) / tag;
    checkpoint::save_checkpoint_file((to / capture::kCheckpointFile).string(), d);
    try {
      capture::replay_capture(to.string(), {});
      ADD_FAILURE() << tag << ": replayed";
    } catch (const checkpoint::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find((to / capture::kCheckpointFile).string() + ": " + want), std::string::npos)
          << tag << ": " << e.what();
    }
  };
  damaged("five", [](auto& d) {
    auto info = nlohmann::json::parse(d.blob("capture"));
    info["micro_batches"] = 5;
    d.blobs["capture"] = info.dump();
  }, "an incomplete capture: its record says 5 micro-batch(es), it holds 1");
  damaged("not_json", [](auto& d) { d.blobs["capture_batches"] = "{not json"; },
          "the capture's batch record (blob 'capture_batches') is not a JSON list");
  damaged("none", [](auto& d) {
    auto info = nlohmann::json::parse(d.blob("capture"));
    info["micro_batches"] = 0;
    d.blobs["capture"] = info.dump();
    d.blobs["capture_batches"] = "[]";
    for (auto it = d.tensors.begin(); it != d.tensors.end();)
      it = it->first.rfind("capture/batch/", 0) == 0 ? d.tensors.erase(it) : std::next(it);
  }, "the capture holds no batches");
  damaged("no_count", [](auto& d) {
    auto info = nlohmann::json::parse(d.blob("capture"));
    info.erase("micro_batches");
    d.blobs["capture"] = info.dump();
  }, "the capture record has no micro_batches count");
  damaged("no_label", [](auto& d) { d.tensors.erase("capture/batch/0/label"); },
          "the capture's batch 0 lacks its tensor 'label' (capture/batch/0/label)");
  // A path that cannot be read, and a nan/ folder whose only step_<N> entry is a symlink loop: one line each.
  auto refused = [](const fs::path& path, const std::string& want) {
    try {
      capture::replay_capture(path.string(), {});
      ADD_FAILURE() << path << " replayed";
    } catch (const checkpoint::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(path.string() + want), std::string::npos) << e.what();
    }
  };
  const fs::path loop = fs::path(dir) / "loop";
  fs::create_symlink(loop, loop);
  refused(loop, ": cannot be read (Too many levels of symbolic links)");
  const fs::path looped = fs::path(dir) / "looped_nan";
  fs::create_directories(looped);
  fs::create_symlink(looped / "step_99", looped / "step_99");
  refused(looped, ": not a NaN capture (no capture.ckpt here and no step_<N> capture inside)");
}

TEST(NanCapture, TracerCostsNothingWhenNotInstalledAndNamesParameterModules) {
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
  auto x = torch::randn({3, 4});
  {
    torch::NoGradGuard ng;
    net->named_parameters()["1.weight"].fill_(std::numeric_limits<float>::infinity());
  }
  {
    NonFiniteTracer tracer(*net);
    net->forward(x);
    auto first = tracer.first();
    ASSERT_TRUE(first.has_value());
    EXPECT_EQ(first->module, "1");
    EXPECT_FALSE(first->inputs_finite);  // the parameter was already non-finite: said so
    EXPECT_GT(tracer.ops_observed(), 0);
  }
  EXPECT_FALSE(at::hasGlobalCallbacks());
}

// A fused op's backward (a custom autograd Function: strobe::add_rms_norm) inherits the module of
// its forward, as ATen's backward functions do.
TEST(NanCapture, TracerNamesTheModuleOfAFusedOpsBackward) {
  struct Net : torch::nn::Module {
    Net() { norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8}))); }
    torch::nn::LayerNorm norm{nullptr};
  };
  auto net = std::make_shared<Net>();
  const auto x = torch::randn({3, 8}).requires_grad_();
  auto gy = torch::randn({3, 8});
  gy[1][2] = NAN;
  NonFiniteTracer tracer(*net);
  const auto y = strobe::ops::rms_norm(x, net->norm->weight, 1e-6);
  y.backward(gy);
  auto first = tracer.first();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->phase, "backward");
  EXPECT_EQ(first->op, "strobe::add_rms_norm_bwd");
  EXPECT_EQ(first->module, "norm") << first->note;
}

// A run resumed from a checkpoint taken mid-way through gradient accumulation: the step that began
// before the resume is still checked, but its first micro-batches are not in this process, so a
// non-finite verdict stops the run (exit 3) without a capture (the resume used to crash here).
TEST(NanCapture, AStepBegunBeforeAResumeMidAccumulationStopsWithoutACapture) {
  auto means = strobe::testing::batch_means(probe_yaml("none", 1e9, "[]", 24), 24);
  // The first batch exceeding every earlier one at an odd index: the second micro-batch of its step.
  const auto rise = strobe::testing::first_rise(means, [](size_t i) { return i >= 3 && i % 2 == 1; });
  ASSERT_TRUE(rise.has_value()) << "no usable batch in this data";
  const size_t bad = rise->index;
  const double thr = threshold_first_bad_at(means, bad);
  const std::vector<std::string> sets = {"trainer.accumulate_grad_batches=2"};
  const std::string yaml = probe_yaml("forward", thr, "[{name: nan_capture}]", 24);
  const auto dir = temp_dir("nan-partial");
  const std::string ckpt = dir + "/mid.ckpt";
  // Run A saves a checkpoint after batch bad - 1, the first micro-batch of the bad batch's step.
  struct SaveMid : Callback {
    int64_t at = 0;
    std::string path;
    std::string name() const override { return "save_mid"; }
    void on_train_batch_complete(TrainerView& t, Module&) override {
      if (t.state().batch_in_epoch == at && t.accumulated_batches() == 1) checkpoint::save_checkpoint_file(path, t.make_checkpoint());
    }
  };
  {
    auto saver = std::make_shared<SaveMid>();
    saver->at = static_cast<int64_t>(bad);
    saver->path = ckpt;
    auto a = strobe::testing::make_run(yaml, sets, dir + "/a", std::nullopt, {saver});
    EXPECT_EQ(a->trainer->fit(), 3);  // run A itself captures the bad step
    EXPECT_TRUE(fs::exists(fs::path(dir) / "a" / "nan"));
  }
  ASSERT_TRUE(fs::exists(ckpt));
  auto b = strobe::testing::make_run(yaml, sets, dir + "/b", ckpt);
  ::testing::internal::CaptureStderr();
  const int rc = b->trainer->fit(std::move(b->checkpoint));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 3) << err;
  EXPECT_NE(err.find("nan_capture: non-finite "), std::string::npos) << err;
  EXPECT_NE(err.find(fmt::format(" at step {} ", bad / 2 + 1)), std::string::npos) << err;
  EXPECT_NE(err.find("began before this run resumed from a checkpoint taken mid-way through gradient accumulation, "
                     "so it cannot be captured"),
            std::string::npos)
      << err;
  EXPECT_FALSE(fs::exists(fs::path(dir) / "b" / "nan")) << "no capture of a partial step";
}

// ---- Loss spikes (nan_capture.spike) ----

// Each step's loss, skip flag and spike statistics, read on the host (a test may sync).
class SpikeRecorder : public Callback {
 public:
  std::string name() const override { return "spike_recorder"; }
  void on_before_zero_grad(TrainerView& t, Module&, torch::optim::Optimizer&) override {
    const auto& r = t.step_access().step_pipeline().last();
    losses.push_back(r.losses.at(0).item<double>());
    skipped.push_back(r.skipped.item<float>() != 0.f);
    stats.push_back(r.spike_stats.to(torch::kFloat64));
  }
  std::vector<double> losses;
  std::vector<bool> skipped;
  std::vector<torch::Tensor> stats;
};

// The detector against a float64 reference: the window of the last 8 accepted losses, spikes past
// warm-up at mean + 4 std (population); spiking steps are skipped and never enter the window.
TEST(NanCaptureSpike, SkipStepFollowsAFloat64ReferenceOfTheRollingWindow) {
  auto means = batch_means(32);
  size_t bad_count = 0;
  const double thr = threshold_first_bad_at(means, first_exceeding(means, 6), &bad_count);
  auto rec = std::make_shared<SpikeRecorder>();
  const auto dir = temp_dir("spike-skip");
  auto run = make_run(probe_yaml("spike", thr,
                                 "[{name: nan_capture, spike: {action: skip_step, window: 8, warmup: 5, zscore: 4, "
                                 "max_consecutive: 32}}]",
                                 32),
                      dir, {rec});
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(run->trainer->fit(), 0);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(rec->losses.size(), 32u);
  std::deque<double> window;
  int64_t spikes = 0;
  for (size_t i = 0; i < rec->losses.size(); ++i) {
    double mean = 0, var = 0;
    for (double v : window) mean += v;
    mean /= std::max<size_t>(window.size(), 1);
    for (double v : window) var += (v - mean) * (v - mean);
    const double sd = std::sqrt(var / std::max<size_t>(window.size(), 1));
    const auto& st = rec->stats[i];
    EXPECT_NEAR(st[kLossMean].item<double>(), mean, 1e-5 * std::max(1.0, std::abs(mean))) << "step " << i + 1;
    EXPECT_NEAR(st[kLossStd].item<double>(), sd, 1e-5 * std::max(1.0, sd)) << "step " << i + 1;
    const bool spike = window.size() >= 5 && rec->losses[i] > mean + 4 * sd;
    EXPECT_EQ(rec->skipped[i], spike) << "step " << i + 1 << " loss " << rec->losses[i] << " mean " << mean << " std " << sd;
    if (spike) {
      ++spikes;
      EXPECT_NE(err.find(fmt::format("loss spike {:.6g} (mean", static_cast<float>(rec->losses[i]))), std::string::npos) << err;
      continue;
    }
    window.push_back(rec->losses[i]);
    if (window.size() > 8) window.pop_front();
  }
  EXPECT_GE(spikes, static_cast<int64_t>(bad_count)) << "every scaled batch spikes";
  run->trainer->view().drain_metrics();
  ASSERT_TRUE(run->trainer->view().metrics().count("train/spikes"));
  EXPECT_EQ(run->trainer->view().metrics().at("train/spikes"), static_cast<double>(spikes));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "nan"));
}

// action stop: the spiking step is captured with the weights from before it, and replays exactly.
TEST(NanCaptureSpike, StopCapturesTheSpikingStepAndReplaysIt) {
  auto means = batch_means(32);
  const size_t bad = first_exceeding(means, 6);
  ASSERT_LT(bad, means.size());
  const double thr = threshold_first_bad_at(means, bad);
  const auto dir = temp_dir("spike-stop");
  {
    auto run = make_run(probe_yaml("spike", thr, "[{name: nan_capture, spike: {window: 16, warmup: 4}}]", 32), dir);
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(run->trainer->fit(), 3);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find(fmt::format("nan_capture: loss spike ")), std::string::npos) << err;
    EXPECT_NE(err.find(fmt::format(" at step {} ", bad + 1)), std::string::npos) << err;
  }
  const fs::path cap = fs::path(dir) / "nan" / fmt::format("step_{}", bad + 1);
  ASSERT_TRUE(fs::exists(cap / capture::kCheckpointFile)) << cap;
  auto d = checkpoint::load_checkpoint_file((cap / capture::kCheckpointFile).string());
  auto info = nlohmann::json::parse(d.blob("capture"));
  EXPECT_EQ(info["kind"], "spike");
  const auto& sp = info["spike"]["loss"];
  EXPECT_GT(sp["value"].get<double>(), sp["mean"].get<double>() + 6 * sp["std"].get<double>()) << info.dump(2);
  EXPECT_GT(sp["z"].get<double>(), 6.0);
  // The captured batch's rows are dataset indices (for diagnose and bisect), as is the step before it.
  auto batches = capture::get_batches(d);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].indices.size(), 8u);
  EXPECT_EQ(info["previous_dataset_indices"].size(), 1u);
  std::ifstream summary(cap / "summary.txt");
  std::string text((std::istreambuf_iterator<char>(summary)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.rfind("loss spike ", 0), 0u) << text;

  auto ref = make_run(probe_yaml("spike", thr, "[]", static_cast<int64_t>(bad)), temp_dir("spike-stop-ref"));
  EXPECT_EQ(ref->trainer->fit(), 0);
  std::map<std::string, torch::Tensor> captured;
  for (const auto& [k, t] : d.tensors)
    if (k.rfind("model/", 0) == 0) captured[k] = t;
  expect_bitwise_equal(model_state(*ref->module), captured);

  auto report = capture::replay_capture(dir + "/nan", {});
  EXPECT_TRUE(report["exact"].get<bool>()) << report.dump(2);
  EXPECT_TRUE(report["first_nonfinite"].is_null());
}

// action skip_step, max_consecutive: 1: the first spike stops the run with a capture, saying that
// the threshold may be at fault.
TEST(NanCaptureSpike, MaxConsecutiveSpikesStopTheRunBlamingTheThreshold) {
  auto means = batch_means(32);
  const double thr = threshold_first_bad_at(means, first_exceeding(means, 6));
  const auto dir = temp_dir("spike-consecutive");
  auto run = make_run(probe_yaml("spike", thr, "[{name: nan_capture, spike: {action: skip_step, window: 16, warmup: 4, max_consecutive: 1}}]", 32), dir);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run->trainer->fit(), 3);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("1 spikes in a row: the threshold (zscore 6 over the last 16 accepted steps) may be wrong"), std::string::npos) << err;
  EXPECT_NE(err.find("capture written to"), std::string::npos) << err;
}

// The window is in checkpoints: a run resumed at step 8 decides every later step as the
// uninterrupted run does and ends with the same window, bit for bit.
TEST(NanCaptureSpike, ResumeRestoresTheWindowExactly) {
  auto means = batch_means(32);
  const double thr = threshold_first_bad_at(means, first_exceeding(means, 9));
  const std::string yaml =
      probe_yaml("spike", thr, "[{name: nan_capture, spike: {action: skip_step, window: 8, warmup: 4, max_consecutive: 32}}]", 32);
  const auto dir = temp_dir("spike-resume");
  struct SaveAt : Callback {
    std::string path;
    std::string name() const override { return "save_at"; }
    void on_train_batch_complete(TrainerView& t, Module&) override {
      if (t.state().global_step == 8) checkpoint::save_checkpoint_file(path, t.make_checkpoint());
    }
  };
  auto saver = std::make_shared<SaveAt>();
  saver->path = dir + "/at8.ckpt";
  auto rec_a = std::make_shared<SpikeRecorder>();
  auto a = strobe::testing::make_run(yaml, {}, dir + "/a", std::nullopt, {saver, rec_a});
  ASSERT_EQ(a->trainer->fit(), 0);
  auto rec_b = std::make_shared<SpikeRecorder>();
  auto b = strobe::testing::make_run(yaml, {}, dir + "/b", saver->path, {rec_b});
  ASSERT_EQ(b->trainer->fit(std::move(b->checkpoint)), 0);
  ASSERT_EQ(rec_a->skipped.size(), 32u);
  ASSERT_EQ(rec_b->skipped.size(), 24u);
  int64_t spikes = 0;
  for (size_t i = 0; i < 24; ++i) {
    EXPECT_EQ(rec_b->skipped[i], rec_a->skipped[8 + i]) << "step " << 9 + i;
    EXPECT_TRUE(torch::equal(rec_b->stats[i], rec_a->stats[8 + i])) << "step " << 9 + i;
    spikes += rec_b->skipped[i];
  }
  EXPECT_GE(spikes, 1);
  auto ca = a->trainer->view().make_checkpoint(), cb = b->trainer->view().make_checkpoint();
  for (const char* k : {"step/spike/window", "step/spike/count", "step/spike/pos"})
    EXPECT_TRUE(torch::equal(ca.tensors.at(k), cb.tensors.at(k))) << k;
}

// ---- strobe replay --diagnose: one test per verdict, each from a model that makes that cause ----

nlohmann::json diagnose_after_fit(const std::string& yaml, const std::vector<std::string>& sets, const std::string& tag,
                                  int expect_rc = 3) {
  const auto dir = temp_dir(tag);
  {
    auto run = strobe::testing::make_run(yaml, sets, dir);
    ::testing::internal::CaptureStderr();
    const int rc = run->trainer->fit();
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(rc, expect_rc) << err;
  }
  auto r = capture::diagnose_capture(dir + "/nan", {});
  std::cout << capture::format_diagnosis(r);
  return r;
}

TEST(NanDiagnose, RowsThatAreNonFiniteInEveryPrecisionAreData) {
  // A row's own mean input decides: the threshold lies between the largest row mean of the batches
  // before the first bad one (at step 5 or later) and the largest row mean of that batch.
  auto run0 = strobe::testing::make_run(probe_yaml("none", 1e9, "[]"), {}, "");
  run0->datamodule->setup(Stage::Fit);
  auto loader = run0->datamodule->train_loader();
  std::vector<double> row_max;
  for (int64_t i = 0; i < 32; ++i)
    row_max.push_back(loader->make_batch(0, i).at("image").flatten(1).mean(1).max().item<double>());
  const auto rise = strobe::testing::first_rise(row_max, [](size_t i) { return i >= 4; });
  ASSERT_TRUE(rise.has_value());
  const double thr = rise->threshold;
  auto r = diagnose_after_fit(probe_yaml("rows", thr, "[{name: nan_capture}]", 32), {}, "diag-rows");
  EXPECT_EQ(r["verdict"], "data") << r.dump(2);
  ASSERT_GE(r["rows"].size(), 1u) << r.dump(2);
  auto batch = loader->make_batch(0, static_cast<int64_t>(rise->index));
  auto rows_mean = batch.at("image").flatten(1).mean(1);
  for (const auto& row : r["rows"]) {
    const int64_t i = row["row"].get<int64_t>();
    EXPECT_GT(rows_mean[i].item<double>(), thr) << "row " << i << " is not a bad sample";
    EXPECT_EQ(row["dataset_index"].get<int64_t>(), batch.indices.at(static_cast<size_t>(i)));
  }
  int64_t expected = (rows_mean > thr).sum().item<int64_t>();
  EXPECT_EQ(static_cast<int64_t>(r["rows"].size()), expected);

  // --bisect names the same samples: removing them makes the step finite, and the note says that
  // BatchNorm makes every subset a different computation.
  const std::string cap = r["capture"];
  auto b = capture::bisect_capture(cap, {});
  std::cout << capture::format_bisection(b);
  ASSERT_EQ(b["samples"].size(), r["rows"].size()) << b.dump(2);
  for (size_t i = 0; i < b["samples"].size(); ++i)
    EXPECT_EQ(b["samples"][i]["dataset_index"], r["rows"][i]["dataset_index"]) << b.dump(2);
  EXPECT_FALSE(b["rest_bad"].get<bool>());
  EXPECT_TRUE(b["alone_bad"].get<bool>());
  EXPECT_NE(b["notes"].dump().find("batch-dependent layers in training (bn)"), std::string::npos) << b.dump(2);

  // A capture whose rows carry no dataset indices cannot be bisected: one error naming why.
  const std::string bare = temp_dir("diag-rows-bare");
  auto d = checkpoint::load_checkpoint_file(cap + "/" + capture::kCheckpointFile);
  d.blobs.erase("capture_indices");
  checkpoint::save_checkpoint_file(bare + "/" + capture::kCheckpointFile, d);
  try {
    capture::bisect_capture(bare, {});
    ADD_FAILURE() << "a capture without dataset indices was bisected";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("--bisect needs the dataset index of every row"), std::string::npos) << e.what();
  }
}

TEST(NanDiagnose, AnFp32OverflowThatFloat64DoesNotHaveIsPrecision) {
  auto means = batch_means(32);
  const double thr = threshold_first_bad_at(means, first_exceeding(means, 4));
  auto r = diagnose_after_fit(probe_yaml("overflow", thr, "[{name: nan_capture}]", 32), {}, "diag-overflow");
  EXPECT_EQ(r["verdict"], "precision") << r.dump(2);
  const std::string ev = r["evidence"].dump();
  EXPECT_NE(ev.find("non-finite in fp32 and not in float64"), std::string::npos) << ev;
  EXPECT_NE(ev.find("aten::exp in faulty (forward)"), std::string::npos) << ev;
  EXPECT_NE(ev.find("crossed the Float limit 3.40282e+38"), std::string::npos) << ev;
}

TEST(NanDiagnose, ACorruptWeightIsWeightsNamingTheParameter) {
  auto r = diagnose_after_fit(probe_yaml("none", 1e9, "[{name: nan_capture}]", 32), {"model.nan_weight=true"}, "diag-weights");
  EXPECT_EQ(r["verdict"], "weights") << r.dump(2);
  EXPECT_NE(r["evidence"].dump().find("model/faulty.proj.weight (1 non-finite)"), std::string::npos) << r.dump(2);
}

TEST(NanDiagnose, ASpikeOnOneBatchIsDataAndNoiseIsNotReproducible) {
  auto means = batch_means(32);
  const double thr = threshold_first_bad_at(means, first_exceeding(means, 6));
  const std::string cb = "[{name: nan_capture, spike: {window: 16, warmup: 4}}]";
  auto r = diagnose_after_fit(probe_yaml("spike", thr, cb, 32), {}, "diag-spike");
  EXPECT_EQ(r["verdict"], "data") << r.dump(2);
  EXPECT_NE(r["evidence"].dump().find("while the previous step's batch with the same weights is not"), std::string::npos) << r.dump(2);
  ASSERT_EQ(r["runs"].size(), 4u) << r.dump(2);  // as captured x2, float64, previous batch
  EXPECT_TRUE(r["runs"][2]["bad"].get<bool>()) << "the float64 run spikes too";
  EXPECT_FALSE(r["runs"][3]["bad"].get<bool>()) << "the previous step's batch does not";

  auto n = diagnose_after_fit(probe_yaml("spike", thr, cb, 32), {"model.noise=true"}, "diag-noise");
  EXPECT_EQ(n["verdict"], "not reproducible") << n.dump(2);
  EXPECT_NE(n["evidence"].dump().find("non-deterministic kernels and a hardware fault cannot be told apart"), std::string::npos);
}

}  // namespace
}  // namespace strobe
