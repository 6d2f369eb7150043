// optimizer.param_groups.freeze: frozen parameters take no gradient, no update and no optimizer state
// until the unfreeze epoch, then train at unfreeze_lr_scale x their group's lr; a run resumed on
// either side of the unfreeze (or at it) ends bitwise where the run that never stopped ends;
// BatchNorm layers among them train (train_bn: true, Lightning's default) or stay in eval mode with
// their statistics untouched (false); bad keys exit 2 naming them.
#include <gtest/gtest.h>

#include "strobe/core/trainer_view.h"
#include "tests/cli/cli_test_util.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

// tiny_yaml: an MLP (fc0, fc1, head), 12 steps per epoch, 2 epochs.
const std::string kFreeze = "optimizer.param_groups={freeze: ['fc0.*'], unfreeze_at_epoch: 1, unfreeze_lr_scale: 0.5}";
const std::string kEvery6 = "callbacks:\n  - name: model_checkpoint\n    every_n_steps: 6\n    save_top_k: -1\n";

std::map<std::string, torch::Tensor> optimizer_state_of(Run& run) {
  std::map<const void*, std::string> names;
  for (const auto& p : run.module->net().named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  std::map<std::string, torch::Tensor> out;
  auto* opt = run.trainer->view().optimizer();
  for (const auto& g : opt->param_groups())
    for (const auto& p : g.params())
      if (opt->state().count(p.unsafeGetTensorImpl())) out[names.at(p.unsafeGetTensorImpl())] = p;
  return out;
}

struct FreezeStraight {
  std::string dir;
  std::map<std::string, torch::Tensor> initial, after_epoch0, final;
};

const FreezeStraight& freeze_straight() {
  static FreezeStraight s = [] {
    FreezeStraight r;
    r.dir = temp_dir("freeze-straight");
    auto run = make_run(tiny_yaml() + kEvery6, {kFreeze}, r.dir);
    r.initial = params_of(*run->module);
    for (auto& [k, v] : r.initial) v = v.clone();
    EXPECT_EQ(run->trainer->fit(), 0);
    EXPECT_EQ(run->trainer->view().state().global_step, 24);
    for (auto& [k, v] : model_tensors(r.dir + "/checkpoints/step=12.ckpt")) r.after_epoch0[k.substr(6)] = v;  // "model/"
    r.final = params_of(*run->module);
    return r;
  }();
  return s;
}

}  // namespace

// Epoch 0: fc0 stays bitwise at its initial value (no decay either) while the rest trains, and has
// no optimizer state; epoch 1: it trains, at half the lr (param_groups.txt, lr_monitor).
TEST(Freeze, FrozenParametersTrainFromTheUnfreezeEpoch) {
  const auto& s = freeze_straight();
  for (const char* n : {"fc0.weight", "fc0.bias"}) {
    EXPECT_TRUE(torch::equal(s.after_epoch0.at(n), s.initial.at(n))) << n << " moved while frozen";
    EXPECT_FALSE(torch::equal(s.final.at(n), s.initial.at(n))) << n << " never trained after the unfreeze";
  }
  EXPECT_FALSE(torch::equal(s.after_epoch0.at("fc1.weight"), s.initial.at("fc1.weight")));
  const std::string listing = slurp(s.dir + "/param_groups.txt");
  EXPECT_NE(listing.find("[default/frozen]\nfc0.weight\nfc0.bias\n"), std::string::npos) << listing;
  EXPECT_NE(listing.find("default/frozen        2        0.005          0.5"), std::string::npos) << listing;

  // One epoch only: the optimizer holds no state for the frozen parameters, and the model summary
  // counts them as not trainable.
  const std::string dir = temp_dir("freeze-one-epoch");
  auto run = make_run(tiny_yaml(), {kFreeze, "trainer.max_epochs=1"}, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  const auto state = optimizer_state_of(*run);
  EXPECT_EQ(state.count("fc0.weight") + state.count("fc0.bias"), 0u);
  EXPECT_EQ(state.count("fc1.weight"), 1u);
  EXPECT_NE(slurp(dir + "/model_summary.txt").find("Non-trainable params: 2080"), std::string::npos)
      << slurp(dir + "/model_summary.txt");
}

// Resumed before, at and after the unfreeze: bitwise the straight run's parameters and losses.
TEST(Freeze, ResumeAcrossTheUnfreezeIsExact) {
  const auto& s = freeze_straight();
  for (int64_t step : {6, 12, 18}) {
    const std::string ckpt = s.dir + "/checkpoints/step=" + std::to_string(step) + ".ckpt";
    const std::string dir = temp_dir("freeze-resumed");
    auto run = make_run(tiny_yaml() + kEvery6, {kFreeze}, dir, ckpt);
    ASSERT_EQ(run->trainer->fit(std::move(run->checkpoint)), 0);
    EXPECT_TRUE(bitwise_equal(params_of(*run->module), s.final)) << "parameters differ after resuming from step " << step;
    auto a = read_csv(s.dir + "/metrics.csv", "train/loss"), b = read_csv(dir + "/metrics.csv", "train/loss");
    for (int64_t k = step + 1; k <= 24; ++k) EXPECT_EQ(a[k]["train/loss"], b[k]["train/loss"]) << "step " << k << " from " << step;
  }
  // A resume with another freeze list is refused naming the change.
  const std::string dir = temp_dir("freeze-changed");
  auto r = strobe_cmd("fit -c " + write_config(tiny_yaml()) + " --set \"" + kFreeze.substr(0, kFreeze.find("unfreeze_at")) +
                      "unfreeze_at_epoch: 2}\" --ckpt " + s.dir + "/checkpoints/step=6.ckpt --run-dir " + dir + "/run");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("optimizer.param_groups"), std::string::npos) << r.err;
}

// BatchNorm among the frozen parameters: train_bn (default) trains it, weights and statistics; with
// train_bn: false its weights and running statistics stay as they were through the frozen epoch.
TEST(Freeze, BatchNormTrainsUnlessTrainBnIsFalse) {
  const std::string yaml = R"(name: freezebn
seed: 5
trainer: {max_epochs: 1, num_sanity_val_steps: 0, limit_val_batches: 0, device: cpu, enable_progress_bar: false, enable_model_summary: false}
model: {name: resnet, depth: 18, width: 8, num_classes: 4, stem: cifar}
data: {name: synthetic_images, image_size: 8, channels: 3, num_classes: 4, num_samples: 16, num_val_samples: 4, batch_size: 8, num_workers: 0}
optimizer: {name: sgd, lr: 0.1, momentum: 0.9}
)";
  for (const bool train_bn : {true, false}) {
    auto run = make_run(yaml, {std::string("optimizer.param_groups={freeze: ['conv1.*', 'bn1.*', 'layer1.*'], train_bn: ") +
                                   (train_bn ? "true}" : "false}")},
                        "");
    std::map<std::string, torch::Tensor> before;
    for (const auto& t : run->module->net().named_parameters()) before[t.key()] = t.value().clone();
    for (const auto& t : run->module->net().named_buffers()) before[t.key()] = t.value().clone();
    ASSERT_EQ(run->trainer->fit(), 0);
    std::map<std::string, torch::Tensor> after;
    for (const auto& t : run->module->net().named_parameters()) after[t.key()] = t.value();
    for (const auto& t : run->module->net().named_buffers()) after[t.key()] = t.value();
    const std::string tag = train_bn ? " (train_bn)" : " (train_bn: false)";
    for (const char* n : {"conv1.weight", "layer1.0.conv1.weight"})
      EXPECT_TRUE(torch::equal(after.at(n), before.at(n))) << n << tag;
    for (const char* n : {"bn1.weight", "bn1.running_mean", "layer1.1.bn2.bias", "layer1.1.bn2.running_var"})
      EXPECT_EQ(torch::equal(after.at(n), before.at(n)), !train_bn) << n << tag;
    for (const char* n : {"layer2.0.conv1.weight", "layer2.0.bn1.running_mean", "fc.weight"})
      EXPECT_FALSE(torch::equal(after.at(n), before.at(n))) << n << tag;
  }
}

TEST(Freeze, BadKeysExitTwoNamingThem) {
  struct Case {
    std::string set, expect;
  };
  const std::vector<Case> cases = {
      {"{freeze: ['fc9.*']}", "optimizer.param_groups: freeze[0] 'fc9.*' matches no trainable parameter"},
      {"{unfreeze_at_epoch: 2}", "optimizer.param_groups.unfreeze_at_epoch: applies to the parameters `freeze` lists"},
      {"{freeze: ['fc0.*'], unfreeze_at_epoch: 0}", "optimizer.param_groups.unfreeze_at_epoch"},
      {"{freeze: []}", "optimizer.param_groups.freeze: expected a non-empty list of globs"},
      {"{freeze: ['fc0.*'], unfreeze_lr_scale: 0}", "optimizer.param_groups.unfreeze_lr_scale"},
  };
  for (const auto& c : cases) {
    const std::string dir = temp_dir("badfreeze");
    auto r = strobe_cmd("fit -c " + write_config(tiny_yaml()) + " --set \"optimizer.param_groups=" + c.set + "\" --run-dir " + dir + "/run");
    EXPECT_EQ(r.code, 2) << c.set << ": " << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.set << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
}
