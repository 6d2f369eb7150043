// The swa callback: from swa_epoch_start every step of an epoch trains at SWALR's lr for the epoch
// (cos and linear annealing from the scheduled lr to swa_lrs, the configured cosine schedule
// overridden), the averages equal a float64 mean of the weights at those epochs' ends, a resumed run
// ends with bitwise the same weights and averages, and bad settings are one line, exit 2.
#include <gtest/gtest.h>

#include <cmath>

#include "strobe/core/optim.h"
#include "strobe/core/trainer_view.h"
#include "tests/cli/cli_test_util.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

// Each training step's lr (group 0) by epoch, and the weights (float64) at each epoch's end.
class SwaRecorder : public Callback {
 public:
  std::string name() const override { return "swa_recorder"; }
  void on_train_batch_start(TrainerView& t, Module&, const Batch&, int64_t) override {
    lrs[t.state().epoch].push_back(get_lr(*t.optimizer(), 0));
  }
  void on_train_batch_end(TrainerView& t, Module&, const torch::Tensor&, const Batch&, int64_t) override {
    if (!t.state().epoch_done) return;
    std::map<std::string, torch::Tensor> w;
    for (auto& [name, tensor] : t.weights()) w[name] = tensor.to(torch::kFloat64, false, true);
    ends[t.state().epoch] = std::move(w);
  }
  std::map<int64_t, std::vector<double>> lrs;
  std::map<int64_t, std::map<std::string, torch::Tensor>> ends;
};

std::map<std::string, torch::Tensor> swa_tensors(const checkpoint::CheckpointData& d) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [k, v] : d.tensors)
    if (k.rfind("swa/", 0) == 0) out[k.substr(4)] = v;
  return out;
}

double swa_worst_rel(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  if (got.size() != want.size()) return INFINITY;
  double worst = 0;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    if (it == got.end()) return INFINITY;
    const double scale = std::max(w.abs().max().item<double>(), 1e-6);
    worst = std::max(worst, (it->second.to(torch::kFloat64) - w).abs().max().item<double>() / scale);
    if (!std::isfinite(worst)) return INFINITY;
  }
  return worst;
}

}  // namespace

// 6 epochs of 12 steps under a cosine schedule, SWA from epoch 2 over 3 annealing epochs: epochs 0-1
// follow the schedule, then each epoch's steps all train at swa_lr * a + lr0 * (1 - a) (a of k / 3),
// lr0 the scheduled lr at epoch 2's start; the averages are the mean of the weights at the ends of
// epochs 2-5 (float64 reference).
TEST(Swa, EachEpochTrainsAtSwalrsLrAndTheAverageIsTheMeanOfTheEpochEnds) {
  for (const std::string strategy : {"cos", "linear"}) {
    auto rec = std::make_shared<SwaRecorder>();
    auto run = make_run(tiny_yaml() + "callbacks: [{name: swa, swa_lrs: 0.002, swa_epoch_start: 2, annealing_epochs: 3, "
                                      "annealing_strategy: " + strategy + "}]\n",
                        {"trainer.max_epochs=6", "scheduler.max_steps=72"}, "", std::nullopt, {rec});
    ASSERT_EQ(run->trainer->fit(), 0) << strategy;
    ASSERT_EQ(rec->lrs.size(), 6u);
    const double lr0 = rec->lrs.at(2).front();
    // The schedule itself moves the lr inside epochs 0-1, so a take-over that failed would show.
    EXPECT_NE(rec->lrs.at(1).front(), rec->lrs.at(1).back()) << strategy;
    EXPECT_LT(rec->lrs.at(1).back(), 0.01);
    for (int64_t e = 2; e < 6; ++e) {
      const double x = std::min(1.0, (e - 2) / 3.0);
      const double a = strategy == "cos" ? (1 - std::cos(M_PI * x)) / 2 : x;
      const double want = 0.002 * a + lr0 * (1 - a);
      ASSERT_EQ(rec->lrs.at(e).size(), 12u);
      for (double lr : rec->lrs.at(e)) EXPECT_NEAR(lr, want, 1e-12 * want) << strategy << " epoch " << e;
    }
    std::map<std::string, torch::Tensor> mean;
    for (const auto& [name, w] : rec->ends.at(2)) {
      torch::Tensor sum = torch::zeros_like(w);
      for (int64_t e = 2; e < 6; ++e) sum += rec->ends.at(e).at(name);
      mean[name] = sum / 4.0;
    }
    const auto got = swa_tensors(run->trainer->view().make_checkpoint());
    EXPECT_LT(swa_worst_rel(got, mean), 2e-6) << strategy;
    EXPECT_GT(swa_worst_rel(got, rec->ends.at(5)), 1e-3) << strategy << ": the average is the last weights";
  }
}

// Resumed before SWA, inside its first epoch and inside a later one: bitwise the straight run's
// weights and averages.
TEST(Swa, ResumeIsExact) {
  const std::string yaml = tiny_yaml() + "callbacks: [{name: swa, swa_lrs: 0.002, swa_epoch_start: 0.5, annealing_epochs: 1}, "
                                         "{name: model_checkpoint, every_n_steps: 5, save_top_k: -1}]\n";
  const std::vector<std::string> sets{"trainer.max_epochs=4"};
  const std::string straight = temp_dir("swa-straight");
  auto run = make_run(yaml, sets, straight);
  ASSERT_EQ(run->trainer->fit(), 0);
  const auto last = checkpoint::load_checkpoint_file(straight + "/checkpoints/last.ckpt");
  const auto want = swa_tensors(last);
  ASSERT_FALSE(want.empty());
  for (int64_t step : {15, 30, 40}) {
    const std::string dir = temp_dir("swa-resumed");
    auto resumed = make_run(yaml, sets, dir, straight + "/checkpoints/step=" + std::to_string(step) + ".ckpt");
    ASSERT_EQ(resumed->trainer->fit(std::move(resumed->checkpoint)), 0);
    const auto got = checkpoint::load_checkpoint_file(dir + "/checkpoints/last.ckpt");
    EXPECT_TRUE(bitwise_equal(swa_tensors(got), want)) << "averages differ after resuming from step " << step;
    EXPECT_TRUE(bitwise_equal(params_of(*resumed->module), params_of(*run->module))) << "weights differ after step " << step;
  }
}

// One line, exit 2, before training.
TEST(Swa, BadSettingsAreOneLine) {
  struct Case {
    std::string callbacks, sets, expect;
  } cases[] = {
      {"[{name: swa, swa_lrs: 0.01, swa_epoch_start: 2}]", "", "swa_epoch_start: epoch 2 is past the last epoch, 1"},
      {"[{name: swa, swa_lrs: 0.01}]", "--set trainer.max_epochs=-1 --set trainer.max_steps=10", "set trainer.max_epochs"},
      {"[{name: swa}]", "", "swa_lrs: required"},
      {"[{name: swa, swa_lrs: 0}]", "", "swa_lrs: 0 is not a positive learning rate"},
      {"[{name: swa, swa_lrs: [0.01, 0.02, 0.03]}]", "", "swa_lrs: 3 learning rates for 1 parameter groups"},
      {"[{name: swa, swa_lrs: 0.01, swa_epoch_start: 1.5}]", "", "1.5 is neither an epoch"},
      {"[{name: swa, swa_lrs: 0.01, annealing_strategy: step}]", "", "annealing_strategy"},
      {"[{name: ema}, {name: swa, swa_lrs: 0.01}]", "", "ema and swa both validate on their averages"},
  };
  for (const auto& c : cases) {
    const std::string cfg = write_config(tiny_yaml() + "callbacks: " + c.callbacks + "\n");
    auto r = strobe_cmd("fit -c " + cfg + " " + c.sets + " --run-dir " + temp_dir("swa-bad"));
    EXPECT_EQ(r.code, 2) << c.callbacks << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.callbacks << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
  // ema without validating beside swa is fine.
  const std::string cfg = write_config(tiny_yaml() + "callbacks: [{name: ema, validate: false}, {name: swa, swa_lrs: 0.01}]\n");
  auto ok = strobe_cmd("fit -c " + cfg + " --set trainer.max_epochs=1 --run-dir " + temp_dir("swa-ok"));
  EXPECT_EQ(ok.code, 0) << ok.err;
}
