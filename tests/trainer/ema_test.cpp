// The ema callback: its averages equal a float64 reference of the weights it saw (timm's warm-up
// and a constant decay every second step), validation runs on them and leaves the training weights
// bitwise as they were, a resumed run ends with bitwise the same averages, and `strobe export --ema`
// writes them (refusing a checkpoint without).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "strobe/checkpoint/safetensors.h"
#include "strobe/core/step_pipeline.h"
#include "strobe/core/trainer_view.h"
#include "tests/cli/cli_test_util.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

// The weights after each optimizer step in float64, and whether the step was applied.
class WeightRecorder : public Callback {
 public:
  std::string name() const override { return "weight_recorder"; }
  void on_before_zero_grad(TrainerView& t, Module&, torch::optim::Optimizer&) override {
    std::map<std::string, torch::Tensor> w;
    for (auto& [name, tensor] : t.weights()) w[name] = tensor.to(torch::kFloat64, false, true);
    steps.push_back(std::move(w));
    const auto& skipped = t.step_access().step_pipeline().last().skipped;
    applied.push_back(!skipped.defined() || skipped.item<float>() == 0.f);
  }
  std::vector<std::map<std::string, torch::Tensor>> steps;
  std::vector<bool> applied;
};

// The reference: update k (0-based) at every `every`-th step uses d = 0 for k = 0, then decay or
// timm's warm-up min(decay, 1 - (1 + k)^(-2/3)); a skipped step moves nothing.
std::map<std::string, torch::Tensor> reference(const WeightRecorder& rec, const std::map<std::string, torch::Tensor>& initial,
                                               double decay, bool warmup, int64_t every) {
  std::map<std::string, torch::Tensor> avg;
  for (auto& [k, v] : initial) avg[k] = v.to(torch::kFloat64);
  for (size_t i = 0; i < rec.steps.size(); ++i) {
    const int64_t step = static_cast<int64_t>(i) + 1;
    if (step % every != 0) continue;
    const int64_t k = step / every - 1;
    const double d = k == 0 ? 0.0 : warmup ? std::min(decay, 1.0 - std::pow(1.0 + k, -2.0 / 3.0)) : decay;
    if (!rec.applied[i]) continue;
    for (auto& [name, a] : avg) a = d * a + (1 - d) * rec.steps[i].at(name);
  }
  return avg;
}

double worst_rel(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  double worst = 0;
  for (const auto& [name, w] : want) {
    auto it = got.find("ema/" + name);
    if (it == got.end()) return INFINITY;
    const double scale = std::max(w.abs().max().item<double>(), 1e-6);
    worst = std::max(worst, (it->second.to(torch::kFloat64) - w).abs().max().item<double>() / scale);
    if (!std::isfinite(worst)) return INFINITY;
  }
  return worst;
}

std::map<std::string, torch::Tensor> ema_tensors(const checkpoint::CheckpointData& d) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [k, v] : d.tensors)
    if (k.rfind("ema/", 0) == 0) out[k] = v;
  return out;
}

}  // namespace

// 50 steps (dropout, cosine schedule): fp32 averages within fp32 rounding of the float64 reference,
// with timm's warm-up and with a constant decay every second step.
TEST(Ema, AveragesEqualAFloat64ReferenceOver50Steps) {
  struct Case {
    std::string cb;
    double decay;
    bool warmup;
    int64_t every;
  };
  for (const Case& c : {Case{"{name: ema, decay: 0.99}", 0.99, true, 1},
                        Case{"{name: ema, decay: 0.9, warmup: false, every_n_steps: 2}", 0.9, false, 2}}) {
    auto rec = std::make_shared<WeightRecorder>();
    auto run = make_run(tiny_yaml() + "callbacks: [" + c.cb + "]\n", {"trainer.max_epochs=5", "trainer.max_steps=50"}, "",
                        std::nullopt, {rec});
    std::map<std::string, torch::Tensor> initial;
    for (const auto& p : run->module->net().named_parameters()) initial[p.key()] = p.value().detach().clone();
    ASSERT_EQ(run->trainer->fit(), 0) << c.cb;
    ASSERT_EQ(rec->steps.size(), 50u);
    const auto got = ema_tensors(run->trainer->view().make_checkpoint());
    ASSERT_EQ(got.size(), initial.size()) << c.cb;
    const double rel = worst_rel(got, reference(*rec, initial, c.decay, c.warmup, c.every));
    EXPECT_LT(rel, 2e-6) << c.cb;
    // The average is not the weights (a test of a copy would pass the above with decay 0).
    EXPECT_GT(worst_rel(got, rec->steps.back()), 1e-3) << c.cb;
  }
}

// validate: true evaluates the averages (the val/loss `strobe validate` gives the exported averages)
// and restores the training weights bitwise: the run trains exactly as with validate: false.
TEST(Ema, ValidationRunsOnTheAveragesAndRestoresTheWeights) {
  std::map<std::string, torch::Tensor> params[2];
  std::string dirs[2];
  for (int validate = 0; validate < 2; ++validate) {
    dirs[validate] = temp_dir("ema-validate");
    auto run = make_run(tiny_yaml() + std::string("callbacks: [{name: ema, decay: 0.9, validate: ") + (validate ? "true" : "false") + "}]\n",
                        {}, dirs[validate]);
    ASSERT_EQ(run->trainer->fit(), 0);
    params[validate] = params_of(*run->module);
  }
  EXPECT_TRUE(bitwise_equal(params[0], params[1])) << "validating on the averages changed the training";
  const auto plain = read_csv(dirs[0] + "/metrics.csv", "val/loss"), averaged = read_csv(dirs[1] + "/metrics.csv", "val/loss");
  ASSERT_TRUE(plain.count(24) && averaged.count(24));
  EXPECT_NE(plain.at(24).at("val/loss"), averaged.at(24).at("val/loss"));
  // The averages at step 24, exported and validated on their own.
  const std::string out = dirs[1] + "/ema.safetensors";
  auto e = strobe_cmd("export " + dirs[1] + "/checkpoints/last.ckpt -o " + out + " --ema");
  ASSERT_EQ(e.code, 0) << e.err;
  const std::string cfg = write_config(tiny_yaml());
  auto v = strobe_cmd("validate -c " + cfg + " --set model.init_from=" + out);
  ASSERT_EQ(v.code, 0) << v.err;
  const auto at = v.out.find("val/loss");
  ASSERT_NE(at, std::string::npos) << v.out;
  const double validated = std::stod(v.out.substr(v.out.find_first_of("0123456789", at + 8)));
  EXPECT_NEAR(validated, std::stod(averaged.at(24).at("val/loss")), 1e-4 * validated) << v.out;
}

// Resumed before and after the epoch boundary: bitwise the straight run's averages; `strobe export
// --ema` writes them; without averages it is one line and exit 2.
TEST(Ema, ResumeIsExactAndExportWritesTheAverages) {
  const std::string yaml = tiny_yaml() + "callbacks: [{name: ema, decay: 0.95}, {name: model_checkpoint, every_n_steps: 6, save_top_k: -1}]\n";
  const std::string straight = temp_dir("ema-straight");
  auto run = make_run(yaml, {}, straight);
  ASSERT_EQ(run->trainer->fit(), 0);
  const auto want = ema_tensors(checkpoint::load_checkpoint_file(straight + "/checkpoints/last.ckpt"));
  ASSERT_FALSE(want.empty());
  for (int64_t step : {6, 18}) {
    const std::string dir = temp_dir("ema-resumed");
    auto resumed = make_run(yaml, {}, dir, straight + "/checkpoints/step=" + std::to_string(step) + ".ckpt");
    ASSERT_EQ(resumed->trainer->fit(std::move(resumed->checkpoint)), 0);
    EXPECT_TRUE(bitwise_equal(ema_tensors(checkpoint::load_checkpoint_file(dir + "/checkpoints/last.ckpt")), want))
        << "averages differ after resuming from step " << step;
  }
  const std::string out = straight + "/ema.safetensors";
  auto e = strobe_cmd("export " + straight + "/checkpoints/last.ckpt -o " + out + " --ema");
  ASSERT_EQ(e.code, 0) << e.err;
  const auto file = safetensors::read_file(out);
  ASSERT_EQ(file.tensors.size(), want.size());
  for (const auto& [name, t] : file.tensors) EXPECT_TRUE(torch::equal(t, want.at("ema/" + name))) << name;
  EXPECT_EQ(file.metadata.at("strobe.ema"), "true");

  const std::string plain = temp_dir("ema-none");
  auto p = make_run(tiny_yaml(), {"trainer.max_epochs=1"}, plain);
  ASSERT_EQ(p->trainer->fit(), 0);
  auto r = strobe_cmd("export " + plain + "/checkpoints/last.ckpt -o " + plain + "/x.safetensors --ema");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--ema: " + plain + "/checkpoints/last.ckpt holds no weight average"), std::string::npos) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
}

namespace strobe {
namespace {

// A crafted or damaged ema state (an average missing, of an integer dtype or another shape, or one
// of no weight) is refused by resume and by export --ema: one line naming the tensor, exit 2.
TEST(Ema, ADamagedAverageIsRefusedNamingItsTensor) {
  const std::string yaml = tiny_yaml() + "callbacks: [{name: ema, decay: 0.95}]\n";
  const std::string dir = temp_dir("ema-damaged");
  auto run = testing::make_run(yaml, {"trainer.max_epochs=1"}, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  const std::string last = dir + "/checkpoints/last.ckpt";
  const auto good = checkpoint::load_checkpoint_file(last);
  const std::string first = good.tensors.lower_bound("ema/")->first;  // the first average, by name
  const std::string cfg = testing::write_config(yaml);
  struct Case {
    std::string name, expect;
    std::function<void(checkpoint::CheckpointData&)> damage;
  } cases[] = {
      {"missing", ": holds ema/ averages but not " + first, [&](auto& d) { d.tensors.erase(first); }},
      {"integer", ": " + first + ": an average of Long elements (expected floating point)",
       [&](auto& d) { d.tensors[first] = d.tensors[first].to(torch::kLong); }},
      {"shape", ": " + first + ": shape [", [&](auto& d) { d.tensors[first] = d.tensors[first].reshape({-1}).narrow(0, 0, 3).clone(); }},
      {"stray", ": ema/fc9.weight: an average of no floating weight of this model",
       [&](auto& d) { d.tensors["ema/fc9.weight"] = torch::zeros({2}); }},
  };
  for (const auto& c : cases) {
    auto d = good;
    c.damage(d);
    const std::string path = dir + "/" + c.name + ".ckpt";
    checkpoint::save_checkpoint_file(path, d);
    for (const std::string& args : {"export " + path + " --ema -o " + dir + "/" + c.name + ".safetensors",
                                    "fit -c " + cfg + " --ckpt " + path + " --run-dir " + dir + "/" + c.name + "_run"}) {
      auto r = testing::strobe_cmd(args);
      EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
      EXPECT_NE(r.err.find("strobe: checkpoint error: " + path + c.expect), std::string::npos) << args << "\n" << r.err;
      EXPECT_EQ(testing::count_lines(r.err), 1) << r.err;
    }
  }
}

}  // namespace
}  // namespace strobe
